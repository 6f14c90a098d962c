"""PromptEOL on an OPT-shaped decoder: our padding-free forward against the same model's padded forward
(transformers' SDPA), same batch, steps alternating in one process (part of `make bench`).

    python benchmarks/prompteol.py [--batch-size 32] [--steps 3] [--threads 2]

The backbone is randomly initialized in OPT-125M's shape (`random_models.opt_decoder`: speed does not
depend on the weights) with a BPE tokenizer trained on the wiki1m mirror, so sentences have an LLM's
token lengths; PromptBERT on a decoder is PromptEOL (`This sentence : "[X]" means in one word:"`, read
at the template's last token), full fine-tuning, the model's own dropout. One step = the forward of
the unsupervised views, InfoNCE, backward, AdamW step (`methods.measure`); median CPU time per step.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from methods import measure
from random_models import opt_decoder

from lightning_sentemb.data.paths import resolve_data_dir
from lightning_sentemb.methods import PromptBERT
from lightning_sentemb.methods.building import build_method


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)  # a 125M model: minutes per run on 2 cores
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data-dir", default=None)
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    corpus = Path(resolve_data_dir(options.data_dir)) / "corpora" / "wiki1m_for_simcse.txt"
    sentences = corpus.read_text(encoding="utf8").splitlines()[: options.batch_size]
    backbone = opt_decoder(os.path.join("out", "bench", "opt-125m"))
    print("| PromptEOL, OPT-125M-shaped (median CPU s per step; wall) | padded (SDPA) | padding-free | speed-up |")
    print("|---|---|---|---|")
    for bf16 in (False, True):
        torch.manual_seed(0)
        method = build_method(PromptBERT, backbone)
        result = measure(method, sentences, options.steps, options.warmup, bf16)
        ratio = result["padded_cpu_s"] / result["fast_cpu_s"]
        print(f"| {'bf16 autocast' if bf16 else 'fp32'}, batch {options.batch_size}, "
              f"{result['real_tokens']:.0%} real tokens | {result['padded_cpu_s']:.2f}; {result['padded_wall_s']:.2f} "
              f"| {result['fast_cpu_s']:.2f}; {result['fast_wall_s']:.2f} | {ratio:.2f}× |")
    load = os.getloadavg()
    print(f"\n{options.steps} alternating steps after {options.warmup}, CPU, {options.threads} threads; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
