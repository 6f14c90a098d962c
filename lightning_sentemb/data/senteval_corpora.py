"""Training corpora derived from the SentEval mirror, named `senteval:<name>` wherever a training file is
(`data.train_file`, `data.datasets.<name>.path`), so that a mixture trains offline with nothing to prepare:

- `senteval:sts`: the unlabeled sentences of the STS sets (ConSERT's corpus, `data.sts_corpus`);
- `senteval:snli-entailment`: the entailment pairs (premise, hypothesis) of the mirror's SNLI splits
  (`senteval/downstream/SNLI`: dev and test, 6,697 pairs), csv `sent0,sent1`;
- `senteval:stsb-pairs`: STS-B train's pairs scored 4 or more (of 5; 1,406 pairs), csv `sent0,sent1`.

Each is written once into the cache directory, named by its source files' identity, then tokenized and
cached like any corpus file. Whitespace is collapsed as SentEval's readers do.
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from ..atomic_io import atomic_write_text
from ..errors import SentEmbUserError
from .nli_pairs import senteval_splits
from .paths import default_cache_dir, require_file
from .senteval import normalize_sentence
from .sts_corpus import source_files, unlabeled_sts_sentences

SCHEME = "senteval:"
STSB_MIN_SCORE = 4.0


def snli_sources(data_dir: Path) -> list[Path]:
    return [path for files in senteval_splits(data_dir / "senteval" / "downstream" / "SNLI") for path in files]


def snli_entailment_pairs(data_dir: Path) -> Iterator[tuple[str, str]]:
    """(premise, hypothesis) of every entailment pair, split after split."""
    for s1, s2, labels in senteval_splits(data_dir / "senteval" / "downstream" / "SNLI"):
        lines = (path.read_text(encoding="utf8").splitlines() for path in (s1, s2, labels))
        for premise, hypothesis, label in zip(*lines, strict=True):
            if label.strip() == "entailment":
                yield normalize_sentence(premise), normalize_sentence(hypothesis)


def stsb_train(data_dir: Path) -> Path:
    return data_dir / "senteval" / "downstream" / "STS" / "STSBenchmark" / "sts-train.csv"


def stsb_similar_pairs(data_dir: Path) -> Iterator[tuple[str, str]]:
    """STS-B train's pairs with a score of at least `STSB_MIN_SCORE` (tab-separated: score, then the pair)."""
    for line in stsb_train(data_dir).read_text(encoding="utf8").splitlines():
        fields = line.split("\t")
        if len(fields) >= 7 and float(fields[4]) >= STSB_MIN_SCORE:
            yield normalize_sentence(fields[5]), normalize_sentence(fields[6])


def pairs_csv(pairs: Iterable[tuple[str, str]]) -> str:
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["sent0", "sent1"])
    writer.writerows(pairs)
    return text.getvalue()


# name -> (file stem, suffix, its source files, its text)
CORPORA: dict[str, tuple[str, str, Callable[[Path], list[Path]], Callable[[Path], str]]] = {
    "sts": ("sts_unlabeled", ".txt", lambda root: [path for path, _, _ in source_files(root)],
            lambda root: "".join(f"{sentence}\n" for sentence in unlabeled_sts_sentences(root))),
    "snli-entailment": ("snli_entailment", ".csv", snli_sources, lambda root: pairs_csv(snli_entailment_pairs(root))),
    "stsb-pairs": ("stsb_pairs", ".csv", lambda root: [stsb_train(root)],
                   lambda root: pairs_csv(stsb_similar_pairs(root))),
}


def derived_corpus_file(name: str, data_dir: Path, cache_dir: str | os.PathLike | None = None) -> Path:
    """The corpus file of `senteval:<name>`, written on first use: staged under a name of this process's,
    then linked into place unless another process was first (every rank then reads one file, whose size
    and time name the tokenized cache)."""
    if name not in CORPORA:
        raise SentEmbUserError(f"{SCHEME}{name}: no such corpus; the SentEval-derived corpora are "
                               f"{', '.join(SCHEME + known for known in CORPORA)}")
    stem, suffix, sources, text = CORPORA[name]
    key = hashlib.sha1()
    for path in sources(data_dir):
        stat = require_file(path, f"SentEval file of {SCHEME}{name}").stat()
        key.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    target = Path(cache_dir or default_cache_dir()) / f"{stem}-{key.hexdigest()[:16]}{suffix}"
    if not target.exists():
        staged = atomic_write_text(target.with_name(f".{target.name}.{os.getpid()}"), text(data_dir))
        try:
            os.link(staged, target)
        except FileExistsError:
            pass
        finally:
            staged.unlink()
    return target


def training_file(path: str, data_dir: Path, cache_dir: str | os.PathLike | None = None) -> str:
    """A training file option's path: `senteval:<name>`'s file, an absolute path, or one under `data_dir`."""
    if path.startswith(SCHEME):
        return str(derived_corpus_file(path[len(SCHEME):], data_dir, cache_dir))
    return path if os.path.isabs(path) else str(data_dir / path)
