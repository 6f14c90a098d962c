"""BERT-whitening (Su et al., 2021, "Whitening Sentence Representations for Better Semantics and
Faster Retrieval"): x̃ = (x − μ)·W[:, :k], with μ the mean of a set of embeddings and W = U·Λ^(−1/2)
from the SVD U·Λ·Uᵀ of their covariance Σ = (1/N)·Σᵢ (xᵢ − μ)ᵀ(xᵢ − μ).

Fitted in fp64 whatever the model's precision. Σ divides by N as the paper writes it; the reference
(bojone/BERT-whitening, `np.cov`) divides by N − 1, which scales every whitened vector by
sqrt((N − 1)/N) and changes no cosine. Where μ and W come from (`--whiten SOURCE`, the paper's
settings): `task`, each evaluated task's own sentences (its "target" setting: each STS task is
whitened by its own fit); `nli`, the sentences of SimCSE's NLI csv (`corpora/nli_for_simcse.csv`
under the data directory: SNLI + MNLI, every column); or a corpus file (one sentence a line, or an
NLI csv).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..data.corpus import CorpusReader, corpus_columns
from ..data.paths import require_file, resolve_data_dir
from ..errors import SentEmbUserError
from ..matryoshka import Encode

NLI_CORPUS = "corpora/nli_for_simcse.csv"


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


def fit_whitening(embeddings: Tensor, dim: int | None = None, source: str = "the sentences") -> Whitening:
    """μ and W[:, :k] of `embeddings` (n, d), k = `dim` or d; `source` names them in the errors."""
    n, d = embeddings.shape
    k = check_whiten_dim(dim, d)
    if n <= k:
        raise SentEmbUserError(f"--whiten {source}: {n} sentence(s) for {k} whitened dimensions; the covariance of n "
                               f"centred sentences has rank n − 1 at most, so whitening needs more than {k} (more "
                               "sentences, or a smaller --whiten-dim)")
    x = embeddings.double()
    mean = x.mean(0)
    centred = x - mean
    u, s, _ = torch.linalg.svd(centred.T @ centred / n)
    if s[k - 1] <= s[0] * 1e-12:
        raise SentEmbUserError(f"--whiten {source}: the {n} sentences' embeddings span fewer than {k} directions "
                               "(repeated sentences, or dimensions the model leaves constant: all-MiniLM-L6-v2 has 3 "
                               "under avg); give a smaller --whiten-dim, or more varied sentences")
    return Whitening(mean, u[:, :k] / s[:k].sqrt())


def whitened(encode: Encode, whitening: Whitening) -> Encode:
    """`encode` whose embeddings are whitened with one fit (a corpus or NLI source)."""

    def encode_whitened(sentences: Sequence[str], **kwargs) -> Tensor:
        return whitening(encode(sentences, **kwargs))

    return encode_whitened


def self_whitened(encode: Encode, dim: int | None, source: str = "task") -> Encode:
    """`encode` whose embeddings of each call are whitened by a fit on that call's own sentences: with
    one call per task (`evaluate_sts(..., per_task=True)`), each task's own whitening."""

    def encode_whitened(sentences: Sequence[str], **kwargs) -> Tensor:
        embeddings = encode(sentences, **kwargs)
        return fit_whitening(embeddings, dim, source)(embeddings)

    return encode_whitened


def source_sentences(source: str, data_dir: str | os.PathLike | None = None) -> list[str]:
    """The distinct sentences of `--whiten nli` or of a corpus file (every column of a csv)."""
    if source == "nli":
        path = require_file(resolve_data_dir(data_dir) / NLI_CORPUS, "--whiten nli: SimCSE's NLI csv")
    elif not Path(source).is_file():
        raise SentEmbUserError(f"--whiten {source}: no such file; give task, nli or a corpus file (one sentence a "
                               "line, or an NLI csv)")
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
