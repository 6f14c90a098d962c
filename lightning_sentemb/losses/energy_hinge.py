"""Energy-based hinge loss: the auxiliary term of the DCPCSE reference's supervised runs
(github.com/YJiangcm/DCPCSE, now PromCSE: `--do_eh_loss --eh_loss_margin 0.2 --eh_loss_weight 10`;
Jiang et al., 2022, "Improved Universal Sentence Embeddings with Prompt-based Contrastive Learning
and Energy-based Learning").

Each anchor's positive must beat its hardest negative by a margin m, on cosine similarities:

    ℓ_EH = mean_i max(0, m − (cos(h_i, h_i⁺) − max_{c ≠ h_i⁺} cos(h_i, c)))

where c runs over every other column of the InfoNCE logits: the other anchors' positives and all
hard negatives. The reference computes it with `nn.MarginRankingLoss` on its logits times τ (= the
cosines), without the hard-negative logit bias, and only when the batch has hard negatives; here it
also applies to in-batch negatives alone, where the reference silently skips it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .info_nce import InfoNCELoss, cosine_matrix

__all__ = ["InfoNCEHingeLoss", "energy_hinge_loss"]


def energy_hinge_loss(
    anchors: Tensor,
    positives: Tensor,
    labels: Tensor,
    hard_negatives: Tensor | None = None,
    margin: float = 0.2,
    drop: Tensor | None = None,
) -> Tensor:
    """ℓ_EH averaged over anchors; `labels[i]` is the column of anchor i's positive in `positives`.
    Columns in `drop` (false negatives) are no candidates for the hardest negative."""
    columns = positives if hard_negatives is None else torch.cat([positives, hard_negatives])
    sim = cosine_matrix(anchors, columns)
    positive = sim.gather(1, labels[:, None]).squeeze(1)
    negatives = sim.scatter(1, labels[:, None], float("-inf"))
    if drop is not None:
        negatives = negatives.masked_fill(drop, float("-inf"))
    hardest_negative = negatives.amax(dim=1)
    return torch.relu(margin - (positive - hardest_negative)).mean()


class InfoNCEHingeLoss(InfoNCELoss):
    """SimCSE's InfoNCE plus `hinge_weight` · ℓ_EH (the reference's total for `--do_eh_loss`)."""

    def __init__(
        self,
        temperature: float = 0.05,
        hard_negative_weight: float = 0.0,
        hinge_margin: float = 0.2,
        hinge_weight: float = 10.0,
    ) -> None:
        super().__init__(temperature, hard_negative_weight)
        self.hinge_margin = hinge_margin
        self.hinge_weight = hinge_weight

    def forward(
        self, anchors: Tensor, positives: Tensor, labels: Tensor, hard_negatives: Tensor | None = None,
        drop: Tensor | None = None,
    ) -> Tensor:
        info_nce = super().forward(anchors, positives, labels, hard_negatives, drop)
        hinge = energy_hinge_loss(anchors, positives, labels, hard_negatives, self.hinge_margin, drop)
        return info_nce + self.hinge_weight * hinge

    def get_config_dict(self) -> dict[str, float]:
        return {**super().get_config_dict(), "hinge_margin": self.hinge_margin, "hinge_weight": self.hinge_weight}
