"""Guided false-negative filtering (GISTEmbed, Solatorio 2024): a guide model's cosine similarities
decide which in-batch (and hard) negatives leave the InfoNCE denominator.

The rule is sentence-transformers' `GISTEmbedLoss` / `CachedGISTEmbedLoss` (6.x): with g the guide's
cosine of anchor i and its own positive, candidate j is dropped when the guide scores it at or above

    absolute: g − margin        relative: g − |g| · margin

The anchor's own positive is never dropped. One difference: sentence-transformers drops only what
scores strictly above, so at margin 0 it keeps a candidate that ties the positive, and a tie is what
a duplicate of the positive (or, in unsupervised SimCSE, where the positive is the anchor's own text,
a duplicate of the anchor) scores; here ties are dropped, so such duplicates leave at any margin. Only the columns the loss already has are judged: our InfoNCE scores anchors against
positives and hard negatives (GIST's optional anchor–anchor and positive–positive blocks are not ours).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from .info_nce import cosine_matrix

__all__ = ["MarginStrategy", "false_negative_mask", "masked_fraction"]

MarginStrategy = Literal["absolute", "relative"]


@torch.no_grad()
def false_negative_mask(
    guide_anchors: Tensor,
    guide_candidates: Tensor,
    labels: Tensor,
    margin: float = 0.0,
    margin_strategy: MarginStrategy = "absolute",
) -> Tensor:
    """(n, m) bool, True where candidate j leaves anchor i's denominator.

    `guide_anchors` (n, d) and `guide_candidates` (m, d) are the guide's embeddings of the rows the
    loss scores (any width: the guide's own); `labels[i]` is the column of anchor i's positive.
    """
    sim = cosine_matrix(guide_anchors, guide_candidates)
    positive = sim.gather(1, labels[:, None])
    if margin_strategy == "absolute":
        threshold = positive - margin
    elif margin_strategy == "relative":
        threshold = positive - positive.abs() * margin
    else:
        raise ValueError(f"margin_strategy must be absolute or relative, got {margin_strategy!r}")
    is_positive = labels[:, None] == torch.arange(sim.size(1), device=sim.device)
    return (sim >= threshold) & ~is_positive


def masked_fraction(mask: Tensor) -> Tensor:
    """The fraction of negatives (every column but each anchor's positive) that `mask` drops; a device
    tensor, logged without reading it back."""
    n, m = mask.shape
    return mask.sum() / max(n * (m - 1), 1)
