"""The bidirectional margin loss (BML) of SNCSE (Wang et al., 2022), which ClusterNS (Deng et al., 2023,
Eq. 4-5) applies to its false negatives: one function for both (`losses.sncse`, `losses.clusterns`)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

__all__ = ["bidirectional_margin_loss", "check_margins"]


def bidirectional_margin_loss(
    sim_other: Tensor,
    sim_pos: Tensor,
    alpha: float,
    beta: float,
    reduction: Literal["mean", "sum", "none"] = "mean",
) -> Tensor:
    """With Δ = cos(x_i, x*) - cos(x_i, x_i^+), ReLU(Δ + α) + ReLU(-Δ - β).

    x* is SNCSE's soft negative (the sentence's negation) or one of ClusterNS's false negatives. Zero iff
    -β <= Δ <= -α: x* should be less similar to the anchor than its positive (by at least α) but not by
    more than β. Inputs broadcast against each other.
    """
    delta = sim_other - sim_pos
    loss = torch.relu(delta + alpha) + torch.relu(-delta - beta)
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    return loss


def check_margins(alpha: float, beta: float) -> None:
    """The loss is zero on [-β, -α] only if α <= β."""
    if alpha > beta:
        raise ValueError(f"BML needs alpha <= beta (Δ in [-β, -α]), got alpha={alpha}, beta={beta}")
