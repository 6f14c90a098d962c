"""Matryoshka embeddings (Kusupati et al., 2022): the first d dimensions of an embedding, re-normalized,
are an embedding of their own. Training applies a method's loss to each truncation (`SentEmbMethod`,
`matryoshka_dims`); evaluation and `sentemb evaluate --dims` score a truncation with `truncate`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


Encode = Callable[..., Tensor]


def truncated(encode: Encode, dim: int) -> Encode:
    """`encode` whose embeddings are truncated to `dim` and re-normalized: what a model trained with
    `matryoshka_dims` serves at that size (sentence-transformers' `truncate_dim`, then cosine)."""

    def encode_truncated(sentences: Sequence[str], **kwargs) -> Tensor:
        return truncate(encode(sentences, **kwargs), dim)

    return encode_truncated


def memoized(encode: Encode) -> Encode:
    """`encode` that keeps the embeddings of each list of sentences it was given, so scoring several
    truncations encodes each evaluation set once (keyword arguments such as a progress label aside)."""
    cache: dict[tuple[str, ...], Tensor] = {}

    def cached(sentences: Sequence[str], **kwargs) -> Tensor:
        key = tuple(sentences)
        if key not in cache:
            cache[key] = encode(list(sentences), **kwargs)
        return cache[key]

    return cached
