"""SNCSE's loss (Wang et al., 2022): InfoNCE over the in-batch negatives plus λ times the bidirectional
margin loss between each anchor's positive and its soft negative, the sentence's negation.

    L = InfoNCE(h_i, h_i^+) + λ · mean_i [ReLU(Δ_i + α) + ReLU(-Δ_i - β)],
    Δ_i = cos(h_i, h_i^sn) - cos(h_i, h_i^+)

as the reference (github.com/Sense-GVT/SNCSE, `simcse/models.py`) computes it: the soft negatives stay
out of the InfoNCE denominator (its commented-out variants put them there as positives or negatives),
the BML averages over the anchors, and both terms read the same embeddings (after the training MLP).
Defaults are the reference's: α 0.1, β 0.3, λ 1e-3 (BERT; RoBERTa 5e-4, set in its configs).
"""

from __future__ import annotations

from torch import Tensor, nn

from .info_nce import info_nce, paired_cosine
from .margin import bidirectional_margin_loss, check_margins

__all__ = ["SNCSELoss"]


class SNCSELoss(nn.Module):
    """InfoNCE + λ·BML over soft negatives.

    Args:
        temperature: τ of the InfoNCE.
        bml_weight: λ.
        bml_alpha: α: the soft negative's cosine at least α below the positive's.
        bml_beta: β: and at most β below it.
    """

    def __init__(self, temperature: float = 0.05, bml_weight: float = 1e-3, bml_alpha: float = 0.1,
                 bml_beta: float = 0.3) -> None:
        super().__init__()
        check_margins(bml_alpha, bml_beta)
        self.temperature = temperature
        self.bml_weight = bml_weight
        self.bml_alpha = bml_alpha
        self.bml_beta = bml_beta

    def forward(self, anchors: Tensor, positives: Tensor, labels: Tensor, soft_negatives: Tensor,
                drop: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """anchors (n, H) and their soft negatives (n, H), local; positives (m, H), the global batch under
        DDP, `labels[i]` the column of anchor i's positive; `drop` (n, m): columns a guide removes from
        the InfoNCE denominator (`losses.guide`). Returns the loss and detached diagnostics."""
        contrastive = info_nce(anchors, positives, labels, self.temperature, drop=drop)
        sim_pos = paired_cosine(anchors, positives.index_select(0, labels))
        sim_soft = paired_cosine(anchors, soft_negatives)
        bml = bidirectional_margin_loss(sim_soft, sim_pos, self.bml_alpha, self.bml_beta)
        stats = {"loss/info_nce": contrastive.detach(), "loss/bml": bml.detach(),
                 "sim/positive": sim_pos.detach().mean(), "sim/soft_negative": sim_soft.detach().mean()}
        return contrastive + self.bml_weight * bml, stats

    def get_config_dict(self) -> dict[str, float]:
        return {"temperature": self.temperature, "bml_weight": self.bml_weight, "bml_alpha": self.bml_alpha,
                "bml_beta": self.bml_beta}
