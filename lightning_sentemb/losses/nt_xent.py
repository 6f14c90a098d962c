"""NT-Xent (SimCLR; ConSERT's Eq. 1): both views of each sentence are anchors, and every other row of
both views is a negative."""

from __future__ import annotations

import torch
from torch import Tensor

from .info_nce import info_nce


def nt_xent(
    view_a: Tensor,
    view_b: Tensor,
    candidates_a: Tensor,
    candidates_b: Tensor,
    labels: Tensor,
    temperature: float,
    drop: Tensor | None = None,
) -> Tensor:
    """ConSERT's L = 1/2N Σ_i [ℓ(a_i, b_i) + ℓ(b_i, a_i)], ℓ(r_i, r_j) = −log exp(cos(r_i, r_j)/τ) /
    Σ_{k ≠ i} exp(cos(r_i, r_k)/τ), k running over the 2N rows of both views.

    `view_a`, `view_b` (n, d): this process's rows of the two views (the anchors); `candidates_a`,
    `candidates_b` (N, d): the global batch's (under DDP gathered with gradients, else the views
    themselves); `labels[i]`: the column of row i among the N. `drop` (n, N) bool: negatives that leave
    every block of anchor i's denominator (a guide's false negatives); the anchor itself always does.
    Each direction is a mean over this process's anchors, so DDP's gradient average gives the global
    mean."""
    columns = torch.arange(candidates_a.size(0), device=labels.device)
    itself = labels[:, None] == columns[None, :]
    other_view = drop if drop is not None else torch.zeros_like(itself)
    mask = torch.cat([other_view, itself | other_view], dim=1)
    loss_a = info_nce(view_a, torch.cat([candidates_b, candidates_a]), labels, temperature, drop=mask)
    loss_b = info_nce(view_b, torch.cat([candidates_a, candidates_b]), labels, temperature, drop=mask)
    return (loss_a + loss_b) / 2
