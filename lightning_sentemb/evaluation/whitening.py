"""BERT-whitening (Su et al., 2021, "Whitening Sentence Representations for Better Semantics and
Faster Retrieval"): x̃ = (x − μ)·W[:, :k], with μ the mean of a set of embeddings and W = U·Λ^(−1/2)
from the SVD U·Λ·Uᵀ of their covariance Σ = (1/N)·Σᵢ (xᵢ − μ)ᵀ(xᵢ − μ).

Fitted in fp64 whatever the model's precision. Σ divides by N as the paper writes it; the reference
(bojone/BERT-whitening, `np.cov`) divides by N − 1, which scales every whitened vector by
sqrt((N − 1)/N) and changes no cosine. Without a k, the whitening keeps every direction the
embeddings span (k = Σ's numerical rank, `RANK_TOLERANCE`), one line saying so when that is fewer
than the model's width. Where μ and W come from (`--whiten SOURCE`): `target`, the reference's
"target" setting (eng/eval.py): each STS task whitened by a fit on every pair of its splits, train,
dev and test for STS-B and SICK-R, the year's test sets for STS12–16 (both sides of each pair, repeats
counted, as `compute_kernel_bias` concatenates them); `task`, each task's own test sentences (distinct),
no train or dev; `nli`, the sentences of SimCSE's NLI csv (`corpora/nli_for_simcse.csv` under the data
directory: SNLI + MNLI, every column; the reference's `nli` fits on MNLI train and SNLI train, dev and
test pairs); or a corpus file (one sentence a line, or an NLI csv).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..data.corpus import CorpusReader, corpus_columns
from ..data.paths import require_file, resolve_data_dir
from ..data.senteval import StsTask, read_sick, read_stsb
from ..errors import SentEmbUserError
from ..matryoshka import Encode

NLI_CORPUS = "corpora/nli_for_simcse.csv"
# an eigenvalue of Σ at most this fraction of the largest is zero: a direction the embeddings do not span
# (a dimension the model leaves constant: all-MiniLM-L6-v2 has 3 under avg)
RANK_TOLERANCE = 1e-12
# `--whiten target`: the splits fitted on beside a task's test set (senteval/downstream/...), by reader
TARGET_SPLITS = {
    "STSBenchmark": (read_stsb, ("STS/STSBenchmark/sts-train.csv", "STS/STSBenchmark/sts-dev.csv")),
    "SICKRelatedness": (read_sick, ("SICK/SICK_train.txt", "SICK/SICK_trial.txt")),
}


@dataclass(frozen=True)
class Whitening:
    """μ (d,) and W[:, :k] (d, k), fp64."""

    mean: Tensor
    kernel: Tensor

    def __call__(self, embeddings: Tensor) -> Tensor:
        """(n, k) float32 whitened rows of (n, d) embeddings."""
        return ((embeddings.double() - self.mean) @ self.kernel).float()


def check_whiten_dim(dim: int | None, size: int) -> int:
    """The whitened size k (`dim`, or the model's `size`), refused in one line outside 1..size: checked
    before any sentence is encoded."""
    k = size if dim is None else dim
    if not 0 < k <= size:
        raise SentEmbUserError(f"--whiten-dim {k}: choose 1 to {size}, the model's embedding size")
    return k


def fit_whitening(embeddings: Tensor, dim: int | None = None, source: str = "the sentences",
                  say: Callable[[str], None] = print) -> Whitening:
    """μ and W[:, :k] of `embeddings` (n, d): k = `dim`, refused above the rank of their covariance, or
    that rank (`say` tells when it is below d); `source` names them in the lines."""
    n, d = embeddings.shape
    if dim is not None:
        check_whiten_dim(dim, d)
        if n <= dim:
            raise SentEmbUserError(f"--whiten {source}: {n} sentence(s) for {dim} whitened dimensions; the covariance "
                                   f"of n centred sentences has rank n − 1 at most, so whitening needs more than {dim} "
                                   "(more sentences, or a smaller --whiten-dim)")
    x = embeddings.double()
    mean = x.mean(0)
    centred = x - mean
    u, s, _ = torch.linalg.svd(centred.T @ centred / n)
    rank = int((s > s[0] * RANK_TOLERANCE).sum())
    if rank == 0:
        raise SentEmbUserError(f"--whiten {source}: the {n} sentences' embeddings are all equal; nothing to whiten")
    if dim is not None and dim > rank:
        raise SentEmbUserError(f"--whiten {source}: the {n} sentences' embeddings span fewer than {dim} directions "
                               f"({rank}: repeated sentences, or dimensions the model leaves constant); give "
                               f"--whiten-dim {rank} or less, leave it out (whitens within the span), or give more "
                               "varied sentences")
    k = rank if dim is None else dim
    if dim is None and rank < d:
        say(f"--whiten {source}: the {n} sentences' embeddings span {rank} of {d} directions; whitened within "
            f"them, {rank} dimensions (--whiten-dim K keeps K ≤ {rank})")
    return Whitening(mean, u[:, :k] / s[:k].sqrt())


def whitened(encode: Encode, whitening: Whitening) -> Encode:
    """`encode` whose embeddings are whitened with one fit (a corpus or NLI source)."""

    def encode_whitened(sentences: Sequence[str], **kwargs) -> Tensor:
        return whitening(encode(sentences, **kwargs))

    return encode_whitened


def per_task_whitened(encode: Encode, fit_sentences: Callable[[str, list[str]], list[str]], dim: int | None,
                      source: str) -> Encode:
    """`encode` for `evaluate_sts(..., per_task=True)`, which calls it once per task, `task=NAME`: the
    task's embeddings whitened by a fit on `fit_sentences(NAME, its sentences)`. The span line is said
    once (for the first task whose span is short)."""
    said: list[str] = []

    def say_once(line: str) -> None:
        if not said:
            said.append(line)
            print(f"{line}; each task is fitted on its own (k may differ by task)", flush=True)

    def encode_whitened(sentences: Sequence[str], task: str, **kwargs) -> Tensor:
        fit_on = fit_sentences(task, list(sentences))
        distinct = list(dict.fromkeys([*sentences, *fit_on]))
        row = {s: i for i, s in enumerate(distinct)}
        embeddings = encode(distinct, **kwargs)
        whitening = fit_whitening(embeddings[[row[s] for s in fit_on]], dim, f"{source} ({task})", say_once)
        return whitening(embeddings[[row[s] for s in sentences]])

    return encode_whitened


def own_sentences(task: str, sentences: list[str]) -> list[str]:
    """`--whiten task`: a task fitted on its own (distinct) sentences."""
    return sentences


def target_sentences(tasks: Sequence[StsTask], data_dir: str | os.PathLike | None = None,
                     limit: Callable[[StsTask], StsTask] = lambda task: task) -> Callable[[str, list[str]], list[str]]:
    """`--whiten target`: what the reference fits a task on, by its name: both sides of every pair of its
    splits (`TARGET_SPLITS` beside its test set), repeats counted; `limit` caps each extra split as the
    plan capped the tasks (`--max-examples`). Read now, so a missing file is one line before any encoding."""
    root = resolve_data_dir(data_dir) / "senteval" / "downstream"
    fits = {}
    for task in tasks:
        reader, files = TARGET_SPLITS.get(task.name, (None, ()))
        splits = [task, *(limit(reader(require_file(root / file, f"--whiten target: {task.name}'s split"), task.name))
                          for file in files)]
        fits[task.name] = [s for part in splits for s in part.first + part.second]
    return lambda task, sentences: fits[task]


def source_sentences(source: str, data_dir: str | os.PathLike | None = None) -> list[str]:
    """The distinct sentences of `--whiten nli` or of a corpus file (every column of a csv)."""
    if source == "nli":
        path = require_file(resolve_data_dir(data_dir) / NLI_CORPUS, "--whiten nli: SimCSE's NLI csv")
    elif not Path(source).is_file():
        raise SentEmbUserError(f"--whiten {source}: no such file; give target, task, nli or a corpus file (one "
                               "sentence a line, or an NLI csv)")
    else:
        path = Path(source)
    sentences: dict[str, None] = {}
    columns = None
    for chunk in CorpusReader(path):
        if columns is None:  # every text column of the file's layout (`data.corpus.corpus_columns`)
            columns = [column for column in corpus_columns(chunk, str(path)) if column != "label"]
        sentences.update(dict.fromkeys(s for column in columns for s in chunk[column]))
    if not sentences:
        raise SentEmbUserError(f"--whiten {source}: {path} holds no sentences")
    return list(sentences)
