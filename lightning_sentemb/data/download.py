"""Fetch the data sets from their canonical sources, or check an existing mirror."""

from __future__ import annotations

import csv
import os
import shutil
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

from ..errors import SentEmbUserError
from .paths import require_file, resolve_data_dir

SIMCSE_REPO = "princeton-nlp/datasets-for-simcse"
# SNLI + MNLI train with their labels (942,069 pairs), as sentence-transformers trains SBERT on them
ALLNLI_REPO = "sentence-transformers/all-nli"
SOURCES = {  # what: (Hugging Face dataset repo, file in it, destination under the data dir)
    "senteval": (SIMCSE_REPO, "senteval.tar", "senteval/downstream"),
    "wiki1m": (SIMCSE_REPO, "wiki1m_for_simcse.txt", "corpora/wiki1m_for_simcse.txt"),
    "nli": (SIMCSE_REPO, "nli_for_simcse.csv", "corpora/nli_for_simcse.csv"),
    "allnli": (ALLNLI_REPO, "pair-class/train-00000-of-00001.parquet", "corpora/allnli_pairs.csv"),
}
# Lines of the published corpora (SimCSE's wiki1m: one million sentences), to call a shorter copy a subset.
FULL_CORPUS_LINES = {"wiki1m": 1_000_000}
# What `sentemb data check` reports, per evaluator / corpus, and the `download` item that fetches it
# (None: not fetched by `sentemb data download`; the clustering sets come from SCCL's and the
# datasets' own pages).
CHECK_GROUPS: dict[str, tuple[str, str | None]] = {
    "sts": ("STS12-16, STS-B, SICK-R and their dev sets: every fit, --tasks sts", "senteval"),
    "transfer": ("SentEval transfer tasks: --tasks transfer,fewshot", "senteval"),
    "cluster": ("short-text clustering, DBpedia, AG News: --tasks cluster", None),
    "wiki1m": ("unsupervised training corpus", "wiki1m"),
    "nli": ("supervised training corpus (*_sup.yaml)", "nli"),
    "allnli": ("labelled NLI pairs (SBERT, sbert_sup.yaml)", "allnli"),
}


def _downstream_root(extracted: Path) -> Path:
    """The folder of the unpacked tar that holds `STS/` (its nesting differs between copies)."""
    for candidate in [extracted, *sorted(p for p in extracted.rglob("*") if p.is_dir())]:
        if (candidate / "STS").is_dir():
            return candidate
    raise FileNotFoundError(f"no STS/ folder inside the unpacked senteval.tar at {extracted}")


def download(to: str | os.PathLike, what: list[str]) -> None:
    """Download each requested item into `to`, via a temporary folder and a final rename."""
    from huggingface_hub import hf_hub_download

    root = Path(to)
    unknown = set(what) - set(SOURCES)
    if unknown:
        raise ValueError(f"unknown data item(s) {sorted(unknown)}; choose from {', '.join(SOURCES)}")
    for item in what:
        repo, filename, destination = SOURCES[item]
        target = root / destination
        if target.exists():
            print(f"{target} exists; skipped")
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            fetched = Path(hf_hub_download(repo, filename, repo_type="dataset", local_dir=tmp))
            if filename.endswith(".tar"):
                with tarfile.open(fetched) as archive:
                    archive.extractall(Path(tmp) / "x", filter="data")
                os.replace(_downstream_root(Path(tmp) / "x"), target)
            elif filename.endswith(".parquet"):
                _labelled_pairs_csv(fetched, Path(tmp) / "pairs.csv")
                os.replace(Path(tmp) / "pairs.csv", target)
            else:
                shutil.move(str(fetched), target)
        print(f"{item}: {target}")


def _labelled_pairs_csv(parquet: Path, target: Path) -> None:
    """all-nli's pair-class parquet (premise, hypothesis, label 0-2) as the csv `premise,hypothesis,label`
    with the label names (`data.nli_pairs`)."""
    import pyarrow.parquet as pq

    from .nli_pairs import LABELLED_COLUMNS, NLI_LABELS

    with target.open("w", newline="", encoding="utf8") as file:
        writer = csv.writer(file, lineterminator="\n")
        writer.writerow(LABELLED_COLUMNS)
        for batch in pq.ParquetFile(parquet).iter_batches(columns=list(LABELLED_COLUMNS)):
            columns = batch.to_pydict()
            writer.writerows(zip(columns["premise"], columns["hypothesis"], (NLI_LABELS[i] for i in columns["label"]),
                                 strict=True))


def _subset_note(group: str, root: Path) -> str:
    """`: subset (11,915 of 1,000,000 lines)` for a corpus shorter than the published one (a mirror's
    sample: fine for a demo, not for the papers' numbers), else nothing."""
    expected = FULL_CORPUS_LINES.get(group)
    if expected is None:
        return ""
    lines, last = 0, b"\n"
    with (root / SOURCES[group][2]).open("rb") as file:
        while chunk := file.read(1 << 24):
            lines, last = lines + chunk.count(b"\n"), chunk[-1:]
    lines += last != b"\n"
    return f": subset ({lines:,} of {expected:,} lines)" if lines < expected else ""


def _group_items(group: str, root: Path) -> dict[str, Callable[[], object]]:
    """name -> a loader that raises MissingDataError naming the absent file."""
    from .clustering import CLUSTERING_TASKS, load_clustering_task
    from .senteval import DEV_TASKS, STS_TASKS, load_sts_task
    from .transfer import TRANSFER_TASKS, load_transfer_task

    if group == "sts":
        return {name: partial(load_sts_task, name, root) for name in STS_TASKS + DEV_TASKS}
    if group == "transfer":
        return {name: partial(load_transfer_task, name, root) for name in TRANSFER_TASKS}
    if group == "cluster":
        return {name: partial(load_clustering_task, name, root) for name in CLUSTERING_TASKS}
    destination = SOURCES[group][2]
    return {destination: partial(require_file, root / destination, f"corpus {group}")}


def check_data_dir(data_dir: str | os.PathLike | None = None, required: Sequence[str] = ("sts",)) -> list[str]:
    """Print, per evaluator / corpus (`CHECK_GROUPS`), which of its data sets the directory holds
    (each is read, so a corrupt file shows too); return the `required` groups that are incomplete."""
    unknown = set(required) - set(CHECK_GROUPS)
    if unknown:
        raise SentEmbUserError(f"--require: unknown group(s) {', '.join(sorted(unknown))}; "
                               f"choose from {', '.join(CHECK_GROUPS)} or all")
    root = resolve_data_dir(data_dir)
    print(f"data directory: {root}")
    incomplete = []
    for group, (purpose, item) in CHECK_GROUPS.items():
        problems = []
        items = _group_items(group, root)
        for name, load in items.items():
            try:
                load()
            except (SentEmbUserError, ValueError, UnicodeDecodeError) as error:
                problems.append(f"{name}: {str(error).split('. Fetch it')[0]}")
        state = "ok" if not problems else "missing" if len(problems) == len(items) else "partial"
        fetch = (f"`sentemb data download --to {root} --what {item}`" if item
                 else "not fetched by `sentemb data download`")
        subset = _subset_note(group, root) if not problems else ""
        print(f"{group:9} {state:8} {len(items) - len(problems)}/{len(items)}  {purpose}{subset}")
        for problem in problems:
            print(f"            {problem}")
        if problems:
            print(f"            fetch: {fetch}")
            if group in required:
                incomplete.append(group)
    return incomplete
