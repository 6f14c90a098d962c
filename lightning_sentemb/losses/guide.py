"""Guided false-negative filtering: a guide's cosine similarities decide which in-batch (and hard)
negatives leave the contrastive denominator. Three rules (`methods.guide` says which option picks which):

- GISTEmbed (Solatorio, 2024; sentence-transformers' `GISTEmbedLoss`), a guide model: with g the guide's
  cosine of anchor i and its positive, candidate j leaves when the guide scores it above
  g − margin (absolute) or g − |g|·margin (relative), margin 0 by default.
- Qwen3-Embedding (Zhang et al., 2025, arXiv 2506.05176), the model itself: the same with the model's own
  detached similarities and the threshold g + 0.1 (margin −0.1), and a candidate whose text is the
  positive's leaves too.
- DCLR (Zhou et al., 2022): a fixed threshold φ instead of the positive's score, at or above which the
  complementary model's similarity drops a negative.

Each anchor's own positive always stays; every other column, its own hard negatives included, is judged
(both papers mask an anchor's own hard negative above the threshold: GISTEmbed to catch mined negatives
that are positives, Qwen3-Embedding its m_ik over hard negatives). Only the columns our losses have are
judged: anchors against positives and hard negatives (GIST's optional anchor–anchor and
positive–positive blocks, on by default in sentence-transformers, and Qwen3-Embedding's query–query and
document–document terms, are not ours). The threshold and tie rule are `losses.threshold`'s, which
mining shares.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .info_nce import cosine_matrix
from .threshold import MarginStrategy, Ties, margin_threshold, too_close

__all__ = ["false_negative_mask", "masked_fraction"]


@torch.no_grad()
def false_negative_mask(
    guide_anchors: Tensor,
    guide_candidates: Tensor,
    labels: Tensor,
    margin: float = 0.0,
    margin_strategy: MarginStrategy = "absolute",
    ties: Ties = "kept",
    threshold: float | None = None,
    candidate_keys: Tensor | None = None,
) -> Tensor:
    """(n, m) bool, True where candidate j leaves anchor i's denominator.

    `guide_anchors` (n, d) and `guide_candidates` (m, d) are the guide's embeddings of the rows the
    loss scores (any width: the guide's own); `labels[i]` is the column of anchor i's positive. The
    threshold is the positive's guide score less the margin, or `threshold` when given; `ties` says
    whether a score equal to it stays (`losses.threshold.too_close`). `candidate_keys` (m,): one integer
    per candidate's text, equal for equal texts; a candidate whose key is the positive's leaves.
    """
    sim = cosine_matrix(guide_anchors, guide_candidates)
    if threshold is None:
        mask = too_close(sim, margin_threshold(sim.gather(1, labels[:, None]), margin, margin_strategy), ties)
    else:
        mask = too_close(sim, threshold, ties)
    if candidate_keys is not None:
        mask |= candidate_keys[None, :] == candidate_keys[labels][:, None]
    is_positive = labels[:, None] == torch.arange(sim.size(1), device=sim.device)
    return mask & ~is_positive


def masked_fraction(mask: Tensor) -> Tensor:
    """The fraction of negatives (every column but each anchor's positive) that `mask` drops; a device
    tensor, logged without reading it back."""
    n, m = mask.shape
    return mask.sum() / max(n * (m - 1), 1)
