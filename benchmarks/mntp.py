"""Peak memory of one MNTP training step (part of `make bench`): the LM head on the predicting states alone
(what `MNTP.training_loss` runs) against the same step with the head on every position of the padded batch
(what it ran before, issue 42 item 2), on the CPU, each in a child process of its own.

    python benchmarks/mntp.py [--batch-size 32] [--width 128] [--threads 2]

Backbone: a random Qwen2, 2 layers 64 wide, with Qwen2's 151,936-token vocabulary and its LM head tied to
the input embeddings (Qwen2-0.5B's, the LLM2Vec config's backbone), and a byte-level BPE trained on the
wiki1m mirror. Batch: wiki1m lines, the longest of the first 10,000 among them so the padded batch is
`--width` tokens wide (the LLM2Vec config's `max_seq_len`). One step = forward, loss, backward, AdamW step
in full fine-tuning (fp32; the tied embeddings train), MNTP's defaults otherwise (20% of the tokens).
Peak memory: the resident-set high-water mark (VmHWM) of the child. Target (issue 42): under 1.6 GB
(the head on every position: 7.9 GB when the issue measured it).
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from random_models import TINY_DECODER, wiki_bpe_tokenizer

from lightning_sentemb.data.paths import resolve_data_dir
from lightning_sentemb.losses.mlm import mlm_loss
from lightning_sentemb.methods import MNTP
from lightning_sentemb.methods.building import build_method

QWEN2_VOCAB = 151_936
TARGET_MIB = 1.6 * 1000**3 / 2**20


def tied_qwen2(folder: str) -> str:
    """The benchmark's backbone (see the module docstring), written to `folder`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = wiki_bpe_tokenizer(max_lines=5_000)
    eos = tokenizer.eos_token_id
    config = Qwen2Config(vocab_size=QWEN2_VOCAB, max_position_embeddings=512, pad_token_id=eos, bos_token_id=eos,
                         eos_token_id=eos, tie_word_embeddings=True, **TINY_DECODER)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def batch_of(method: MNTP, batch_size: int, width: int) -> dict:
    """MNTP's training batch of `batch_size` wiki1m lines, `width` tokens wide (see the module docstring)."""
    corpus = Path(resolve_data_dir()) / "corpora" / "wiki1m_for_simcse.txt"
    with corpus.open(encoding="utf8") as file:  # the first lines only: this runs in the measured child
        lines = [line.rstrip("\n") for line in itertools.islice(file, 10_000)]
    format = method.encoder.format
    rows = [ids[: width - format.num_special_tokens] for ids in format.sentence_ids(lines)]
    longest = max(range(len(rows)), key=lambda i: len(rows[i]))
    chosen = [rows[longest]] + [row for i, row in enumerate(rows) if i != longest and row][: batch_size - 1]
    method.collate_generator.manual_seed(0)
    return method.collate([{"sent0": row} for row in chosen])


def step(method: MNTP, batch: dict, every_position: bool) -> None:
    """One training step; `every_position`: the LM head on every position of the padded batch, the loss
    over the labelled ones (the computation before issue 42)."""
    optimizer = torch.optim.AdamW([p for p in method.parameters() if p.requires_grad], lr=1e-5, fused=True)
    if every_position:
        features, predicted = batch["features"], batch["predicted"]
        labels = torch.full((features["input_ids"].numel(),), -100)
        labels[predicted.index] = predicted.labels
        logits = method.encoder.mlm_logits(features["input_ids"], features["attention_mask"], features["layout"],
                                           torch.arange(labels.numel()))
        loss = mlm_loss(logits, labels)
    else:
        loss, _ = method.training_loss(batch)
    loss.backward()
    optimizer.step()


def peak_mib(folder: str, every_position: bool, options: argparse.Namespace) -> float:
    """VmHWM of a child process running one step (`step`)."""
    command = [sys.executable, __file__, "--peak-of", folder, "--batch-size", str(options.batch_size),
               "--width", str(options.width), "--threads", str(options.threads)]
    command += ["--every-position"] if every_position else []
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return float(output.strip().splitlines()[-1]) / 1024  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peak-of", help=argparse.SUPPRESS)
    parser.add_argument("--every-position", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    if options.peak_of:
        torch.manual_seed(0)
        method = build_method(MNTP, options.peak_of)
        step(method, batch_of(method, options.batch_size, options.width), options.every_position)
        status = Path("/proc/self/status").read_text()
        print(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))
        return
    with tempfile.TemporaryDirectory() as folder:
        tied_qwen2(folder)
        method = build_method(MNTP, folder)
        batch = batch_of(method, options.batch_size, options.width)
        shape = tuple(batch["features"]["input_ids"].shape)
        scored = batch["predicted"].count / batch["features"]["input_ids"].numel()
        every, scored_only = peak_mib(folder, True, options), peak_mib(folder, False, options)
    verdict = "met" if scored_only < TARGET_MIB else "MISSED"
    print(f"MNTP step, random Qwen2 2x64 with a tied {QWEN2_VOCAB:,}-token head, batch {shape[0]} x {shape[1]} "
          f"({scored:.1%} of the positions scored), full fine-tuning, fp32, {options.threads} threads")
    print("| LM head on | peak RSS | target < 1.6 GB |")
    print("|---|---|---|")
    print(f"| every position (before) | {every:,.0f} MiB | |")
    print(f"| the predicting states (`PredictedTokens`) | {scored_only:,.0f} MiB | {verdict} "
          f"({every / scored_only:.1f}x less) |")


if __name__ == "__main__":
    main()
