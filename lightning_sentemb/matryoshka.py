"""Matryoshka embeddings (Kusupati et al., 2022): the first d dimensions of an embedding, re-normalized,
are an embedding of their own. Training applies a method's loss to each truncation
(`matryoshka_loss`: a method's `sentence_loss` with `matryoshka_dims`); evaluation and
`sentemb evaluate --dims` score a truncation with `truncate`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import SentEmbUserError


def truncate(embeddings: Tensor, dim: int) -> Tensor:
    """The first `dim` dimensions of each row, L2-normalized, in fp32 (or wider)."""
    prefix = embeddings[..., :dim]
    return F.normalize(prefix.to(torch.promote_types(prefix.dtype, torch.float32)), dim=-1)


def check_dims(dims: Sequence[int], size: int, option: str) -> list[int]:
    """`dims` as a list when each is in 1..`size` and none repeats; else one line naming `option`."""
    dims = [int(d) for d in dims]
    bad = [d for d in dims if not 1 <= d <= size]
    if not dims or bad or len(set(dims)) != len(dims):
        problem = f"{bad} outside 1..{size}" if bad else "empty" if not dims else "a dimension is repeated"
        raise SentEmbUserError(f"{option} {dims}: {problem} (the embedding has {size} dimensions); "
                               f"give distinct sizes such as {[d for d in (size, size // 2, size // 4) if d]}")
    return dims


def check_settings(dims: Sequence[int] | None, weights: Sequence[float] | None, eval_dim: int | None,
                   size: int) -> None:
    """One line for Matryoshka settings (`model.init_args.matryoshka_*`) that cannot apply to an
    embedding of `size` dimensions."""
    if dims is not None:
        check_dims(dims, size, "model.init_args.matryoshka_dims")
    if weights is not None and (dims is None or len(weights) != len(dims)):
        raise SentEmbUserError(
            f"model.init_args.matryoshka_weights {weights}: give one weight per entry of "
            f"model.init_args.matryoshka_dims ({dims})"
        )
    if eval_dim is not None:
        check_dims([eval_dim], size, "model.init_args.matryoshka_eval_dim")


Loss = Callable[[Tensor, dict[str, Any]], tuple[Tensor, dict[str, Tensor]]]


def matryoshka_loss(
    embedding_loss: Loss, embeddings: Tensor, batch: dict[str, Any], dims: Sequence[int],
    weights: Sequence[float] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Σ_d w_d · embedding_loss(truncation to d), each truncation the first d dimensions of every row
    re-normalized (`truncate`), so what a method builds from rows (views, prototypes,
    template-denoised vectors: the bias is subtracted at full size, which truncation commutes with) is
    truncated alike; weights default to 1 each, as sentence-transformers' MatryoshkaLoss. The logged
    values are the loss's at the first listed size, plus each truncation's loss."""
    total, logs = 0.0, {}
    for dim, weight in zip(dims, weights or [1.0] * len(dims), strict=True):
        loss, values = embedding_loss(truncate(embeddings, dim), batch)
        if dim == dims[0]:
            logs.update(values)
        logs[f"matryoshka/loss_{dim}"] = loss.detach()
        total = total + weight * loss
    return total, logs


Encode = Callable[..., Tensor]


def truncated(encode: Encode, dim: int) -> Encode:
    """`encode` whose embeddings are truncated to `dim` and re-normalized: what a model trained with
    `matryoshka_dims` serves at that size (sentence-transformers' `truncate_dim`, then cosine)."""

    def encode_truncated(sentences: Sequence[str], **kwargs) -> Tensor:
        return truncate(encode(sentences, **kwargs), dim)

    return encode_truncated


def memoized(encode: Encode) -> Encode:
    """`encode` that keeps the embedding of every sentence it was given, so scoring several truncations
    (or a whitening beside the model itself) encodes each sentence once, whatever lists it comes in
    (keyword arguments such as a progress label aside; a `prompt` before them is part of the key)."""
    cache: dict[tuple[str | None, str], Tensor] = {}

    def cached(sentences: Sequence[str], **kwargs) -> Tensor:
        if not sentences:
            return encode([], **kwargs)
        prompt = kwargs.get("prompt")
        unseen = [s for s in dict.fromkeys(sentences) if (prompt, s) not in cache]
        if unseen:
            cache.update(zip([(prompt, s) for s in unseen], encode(unseen, **kwargs), strict=True))
        return torch.stack([cache[prompt, s] for s in sentences])

    return cached
