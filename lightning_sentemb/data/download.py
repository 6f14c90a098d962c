"""Fetch the data sets from their canonical sources, or check an existing mirror."""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
from pathlib import Path

from .paths import resolve_data_dir

SIMCSE_REPO = "princeton-nlp/datasets-for-simcse"
SOURCES = {  # what: (file in SimCSE's dataset repo, destination under the data dir)
    "senteval": ("senteval.tar", "senteval/downstream"),
    "wiki1m": ("wiki1m_for_simcse.txt", "corpora/wiki1m_for_simcse.txt"),
    "nli": ("nli_for_simcse.csv", "corpora/nli_for_simcse.csv"),
}
EXPECTED = (
    "senteval/downstream/STS/STS12-en-test/STS.input.MSRpar.txt",
    "senteval/downstream/STS/STS16-en-test/STS.gs.headlines.txt",
    "senteval/downstream/STS/STSBenchmark/sts-dev.csv",
    "senteval/downstream/STS/STSBenchmark/sts-test.csv",
    "senteval/downstream/SICK/SICK_trial.txt",
    "senteval/downstream/SICK/SICK_test_annotated.txt",
    "corpora/wiki1m_for_simcse.txt",
    "corpora/nli_for_simcse.csv",
)


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
        filename, destination = SOURCES[item]
        target = root / destination
        if target.exists():
            print(f"{target} exists; skipped")
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            fetched = Path(hf_hub_download(SIMCSE_REPO, filename, repo_type="dataset", local_dir=tmp))
            if filename.endswith(".tar"):
                with tarfile.open(fetched) as archive:
                    archive.extractall(Path(tmp) / "x", filter="data")
                os.replace(_downstream_root(Path(tmp) / "x"), target)
            else:
                shutil.move(str(fetched), target)
        print(f"{item}: {target}")


def check_data_dir(data_dir: str | os.PathLike | None = None) -> list[str]:
    """Print which expected files exist under the data directory; return the missing ones."""
    root = resolve_data_dir(data_dir)
    missing = [rel for rel in EXPECTED if not (root / rel).exists()]
    for rel in EXPECTED:
        print(f"{'ok     ' if rel not in missing else 'missing'} {root / rel}")
    if missing:
        print(f"{len(missing)} missing: fetch with `sentemb data download --to {root}`")
    return missing
