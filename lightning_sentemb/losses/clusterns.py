"""ClusterNS loss (Deng et al., 2023, §3.2, Eq. 2-6): InfoNCE with centroid hard negatives, and
a bidirectional margin loss (BML, SNCSE's: `losses.margin`) on the in-batch false negatives found by
clustering.

Shapes follow `InfoNCELoss`: `n` local anchors against `m` columns (the global batch under DDP),
`labels[i]` the column of anchor i's positive. The clusters are given per column (`nearest`,
`second_nearest`: centroid ids of the global batch, from the K-means callback's assignment), and
anchor i's cluster is that of its column `labels[i]`.

Paper / reference (github.com/djz233/ClusterNS) details, and the choices made here:

- False negatives (samples j != i of anchor i's cluster) stay in the InfoNCE denominator, as in
  Eq. 2 (sum over all j) and the reference (its mask only feeds the BML); removing them is the
  "mask all false negatives" ablation of Table 4.
- Eq. 2 weights every hard-negative column by μ; the reference adds SimCSE's logit weight
  (log μ) to the anchor's own hard-negative column only. Both are μ = 1 in every reported run.
- BML: Δ_ij = cos(x_i, x_j^+) - cos(x_i, x_i^+) over the false-negative pairs, i.e. the same
  anchor-vs-positive-view similarities as the InfoNCE logits (as the reference). The paper does
  not say how the pairs are reduced. The reference averages over all n*m entries, where the
  entries off the false negatives have Δ = 0 and add the constant α: `"all_pairs"` (default,
  since the published λ = `bml_weight` values were tuned with it) divides the false-negative
  sum by n*m, the reference's gradient exactly and its value less that constant.
  `"false_negatives"` averages over the false-negative pairs only: for the same λ about
  1/(false-negative pair rate) times stronger (~100x at N=512, K=128).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn

from .info_nce import cosine_matrix
from .margin import bidirectional_margin_loss, check_margins

__all__ = ["ClusterNSLoss"]

HardNegatives = Literal["second_nearest", "nearest", "none"]
FalseNegatives = Literal["bml", "mask", "positive", "none"]
BMLReduction = Literal["all_pairs", "false_negatives"]


class ClusterNSLoss(nn.Module):
    """L = L_cl + λ L_bml (Eq. 6), with the ablation switches of Tables 2 and 4.

    Args:
        temperature: τ of the InfoNCE.
        hard_negative_weight: μ, factor on every hard-negative term of the denominator (Eq. 2).
        bml_weight: λ.
        bml_alpha: α, upper margin: Δ <= -α.
        bml_beta: β, lower margin: Δ >= -β.
        hard_negatives: "second_nearest" (paper), "nearest" (Table 2 "repl. harder negative"),
            "none" (Table 2 "w/o hard negative").
        false_negatives: "bml" (paper), "mask" (Table 4: dropped from the denominator),
            "positive" (Table 4: extra positives, -log of the summed softmax mass of the
            positive and the false negatives), "none" (Table 2 "w/o false negative": treated as
            ordinary negatives, no BML).
        bml_reduction: "all_pairs" (reference: sum over the false-negative pairs / (n * m)) or
            "false_negatives" (mean over the false-negative pairs).

    Random clusters (Table 2 "repl. random clusters") are an assignment, see `CentroidState`.
    """

    def __init__(
        self,
        temperature: float = 0.05,
        hard_negative_weight: float = 1.0,
        bml_weight: float = 1e-4,
        bml_alpha: float = 0.2,
        bml_beta: float = 0.5,
        hard_negatives: HardNegatives = "second_nearest",
        false_negatives: FalseNegatives = "bml",
        bml_reduction: BMLReduction = "all_pairs",
    ) -> None:
        super().__init__()
        if hard_negatives not in ("second_nearest", "nearest", "none"):
            raise ValueError(f"hard_negatives must be second_nearest|nearest|none, got {hard_negatives!r}")
        if false_negatives not in ("bml", "mask", "positive", "none"):
            raise ValueError(f"false_negatives must be bml|mask|positive|none, got {false_negatives!r}")
        if bml_reduction not in ("all_pairs", "false_negatives"):
            raise ValueError(f"bml_reduction must be all_pairs|false_negatives, got {bml_reduction!r}")
        if hard_negative_weight <= 0:
            raise ValueError(f"hard_negative_weight μ must be > 0 (or hard_negatives='none'): {hard_negative_weight}")
        check_margins(bml_alpha, bml_beta)
        self.temperature = temperature
        self.hard_negative_weight = hard_negative_weight
        self.bml_weight = bml_weight
        self.bml_alpha = bml_alpha
        self.bml_beta = bml_beta
        self.hard_negatives = hard_negatives
        self.false_negatives = false_negatives
        self.bml_reduction = bml_reduction

    def forward(
        self,
        anchors: Tensor,
        positives: Tensor,
        labels: Tensor,
        centroids: Tensor | None = None,
        nearest: Tensor | None = None,
        second_nearest: Tensor | None = None,
        drop: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Loss and detached diagnostics (the curves of the paper's Figures 3, 4 and 7).

        anchors (n, H); positives (m, H); labels (n,) column of each anchor's positive;
        centroids (K, H) and the columns' cluster ids nearest / second_nearest (m,), all None
        before clustering starts, when the loss is plain InfoNCE (Eq. 1). `drop` (n, m): in-batch
        columns a guide found to be false negatives (`losses.guide`), removed from the logits before
        anything else (denominator, and the numerator of `false_negatives="positive"`); the clusters'
        own false negatives and the BML are decided as without it, so each filter works alone.
        """
        # Gathers and masks rather than Python indexing with tensors, which can sync with the host.
        sim = cosine_matrix(anchors, positives)  # (n, m)
        is_positive = labels[:, None] == torch.arange(sim.shape[1], device=sim.device)
        logits = sim / self.temperature
        if drop is not None:
            logits = logits.masked_fill(drop, float("-inf"))
        pos_sim = sim.gather(1, labels[:, None]).squeeze(1)
        pos_logit = pos_sim / self.temperature
        stats = _similarity_stats(sim, pos_sim)

        if centroids is None:
            loss = (torch.logsumexp(logits, dim=1) - pos_logit).mean()
            stats["loss/info_nce"] = loss.detach()
            return loss, stats
        if nearest is None or second_nearest is None:
            raise ValueError("centroids need the columns' cluster ids `nearest` and `second_nearest`")

        anchor_centroid = cosine_matrix(anchors, centroids)  # (n, K)
        anchor_cluster = nearest.index_select(0, labels)
        false_negative = (anchor_cluster[:, None] == nearest[None, :]) & ~is_positive

        in_batch = logits.masked_fill(false_negative, float("-inf")) if self.false_negatives == "mask" else logits
        columns = [in_batch]
        if self.hard_negatives != "none":
            hard_ids = second_nearest if self.hard_negatives == "second_nearest" else nearest
            # Column j of this block: anchor i against the hard negative of sample j (Eq. 2).
            hard_sim = anchor_centroid.index_select(1, hard_ids)
            columns.append(hard_sim / self.temperature + math.log(self.hard_negative_weight))
        log_denominator = torch.logsumexp(torch.cat(columns, dim=1), dim=1)
        if self.false_negatives == "positive":
            positive_or_false_negative = is_positive | false_negative
            log_numerator = torch.logsumexp(logits.masked_fill(~positive_or_false_negative, float("-inf")), dim=1)
        else:
            log_numerator = pos_logit
        info_nce = (log_denominator - log_numerator).mean()
        loss = info_nce
        stats["loss/info_nce"] = info_nce.detach()

        if self.false_negatives == "bml":
            pair_losses = bidirectional_margin_loss(
                sim, pos_sim[:, None], self.bml_alpha, self.bml_beta, reduction="none"
            ).masked_fill(~false_negative, 0.0)
            if self.bml_reduction == "false_negatives":
                bml = pair_losses.sum() / false_negative.sum().clamp(min=1)
            else:
                bml = pair_losses.sum() / false_negative.numel()
            loss = loss + self.bml_weight * bml
            stats["loss/bml"] = bml.detach()

        stats.update(
            _cluster_stats(
                sim, anchor_centroid, centroids, anchor_cluster, second_nearest.index_select(0, labels), false_negative
            )
        )
        return loss, stats

    def get_config_dict(self) -> dict[str, float | str]:
        return {
            "temperature": self.temperature,
            "hard_negative_weight": self.hard_negative_weight,
            "bml_weight": self.bml_weight,
            "bml_alpha": self.bml_alpha,
            "bml_beta": self.bml_beta,
            "hard_negatives": self.hard_negatives,
            "false_negatives": self.false_negatives,
            "bml_reduction": self.bml_reduction,
        }


@torch.no_grad()
def _similarity_stats(sim: Tensor, pos_sim: Tensor) -> dict[str, Tensor]:
    """Mean positive and in-batch negative similarity (Figure 3); the negatives exclude each
    anchor's positive (the reference's "batch-cos" averages them in)."""
    n, m = sim.shape
    return {
        "sim/positive": pos_sim.mean(),
        "sim/in_batch_negative": (sim.sum() - pos_sim.sum()) / (n * (m - 1)),
    }


@torch.no_grad()
def _cluster_stats(
    sim: Tensor,
    anchor_centroid: Tensor,
    centroids: Tensor,
    anchor_cluster: Tensor,
    anchor_second: Tensor,
    false_negative: Tensor,
) -> dict[str, Tensor]:
    """Figure 3-4 and 7 curves. `sim/hard_negative` is always the second-nearest centroid (the
    paper's hard negative), whatever the ablation feeds the loss; `sim/intra_cluster` is NaN
    when the batch has no false negative."""
    n, m = sim.shape
    k = centroids.shape[0]
    centroid_sim = cosine_matrix(centroids, centroids)
    fn = false_negative.to(sim.dtype)
    return {
        "sim/sample_centroid": anchor_centroid.gather(1, anchor_cluster[:, None]).mean(),
        "sim/hard_negative": anchor_centroid.gather(1, anchor_second[:, None]).mean(),
        "sim/intra_cluster": (sim * fn).sum() / fn.sum(),
        "sim/inter_centroid": (centroid_sim.sum() - centroid_sim.diagonal().sum()) / (k * (k - 1)),
        "false_negative/pair_rate": fn.sum() / (n * (m - 1)),
        "false_negative/sample_rate": false_negative.any(dim=1).to(sim.dtype).mean(),
    }
