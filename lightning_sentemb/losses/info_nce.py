"""InfoNCE over cosine similarities: SimCSE's loss, shared by every method here."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..precision import exact_fp32


def cosine_matrix(a: Tensor, b: Tensor) -> Tensor:
    """(n, m) cosine similarities in fp32 (or wider), under any autocast and with TF32 on, so bf16
    training keeps a sharp softmax: every loss, centroid assignment and false-negative decision reads
    its similarities here (`precision.exact_fp32`)."""
    dtype = torch.promote_types(a.dtype, torch.float32)
    with exact_fp32(a.device.type):
        return F.normalize(a.to(dtype), dim=-1) @ F.normalize(b.to(dtype), dim=-1).T


def paired_cosine(a: Tensor, b: Tensor) -> Tensor:
    """cos(a[..., i, :], b[..., i, :]) of rows that broadcast (SNCSE's pairs; MixCSE's anchor against each of
    its mixes), in fp32 (or wider) under any autocast, as `cosine_matrix`."""
    dtype = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    with exact_fp32(a.device.type):
        return (F.normalize(a.to(dtype), dim=-1) * F.normalize(b.to(dtype), dim=-1)).sum(-1)


def contrastive_logits(
    anchors: Tensor, candidates: Tensor, temperature: float, logit_bias: Tensor | None = None,
    drop: Tensor | None = None,
) -> Tensor:
    """(n, m) cos(anchor_i, candidate_j)/τ + bias, with the `drop` (n, m) bool columns at -inf: they leave
    anchor i's denominator (false negatives, `losses.guide`)."""
    logits = cosine_matrix(anchors, candidates) / temperature
    if logit_bias is not None:
        logits = logits + logit_bias
    return logits if drop is None else logits.masked_fill(drop, float("-inf"))


def own_cosines(anchors: Tensor, candidates: Tensor) -> Tensor:
    """(n, c) cosine similarities of each anchor (n, d) with its own c candidates (n, c, d), in fp32 (or
    wider) as `cosine_matrix`."""
    dtype = torch.promote_types(anchors.dtype, torch.float32)
    with exact_fp32(anchors.device.type):
        return torch.einsum("nd,ncd->nc", F.normalize(anchors.to(dtype), dim=-1),
                            F.normalize(candidates.to(dtype), dim=-1))


def info_nce(
    anchors: Tensor,
    candidates: Tensor,
    labels: Tensor,
    temperature: float = 0.05,
    logit_bias: Tensor | None = None,
    drop: Tensor | None = None,
) -> Tensor:
    """-log softmax(cos(anchor_i, ·)/τ + bias)[labels_i], averaged over anchors.

    `candidates` holds every positive and negative column (under DDP: the global batch);
    `labels[i]` is the column of anchor i's positive; `drop`: see `contrastive_logits`.
    """
    return F.cross_entropy(contrastive_logits(anchors, candidates, temperature, logit_bias, drop), labels)


def hard_negative_bias(labels: Tensor, num_positive_columns: int, weight: float, per_anchor: int = 1) -> Tensor:
    """Logit bias adding `weight` to each anchor's own hard-negative columns.

    The hard negatives sit after the `num_positive_columns` positive columns in `per_anchor` blocks
    (the first hard negative of every example, then the second, ...), each in the positives' order,
    so anchor i's j-th hard negative is column `(1 + j) · num_positive_columns + labels[i]`. This is
    SimCSE's `hard_negative_weight` (added to the scaled logit, i.e. a factor exp(weight) in the
    softmax; 0 leaves hard negatives unweighted, as in the paper's main results).
    """
    bias = torch.zeros(labels.numel(), (1 + per_anchor) * num_positive_columns, device=labels.device)
    blocks = torch.arange(1, 1 + per_anchor, device=labels.device) * num_positive_columns
    return bias.scatter_(1, blocks[None, :] + labels[:, None], weight)


class InfoNCELoss(nn.Module):
    """SimCSE's contrastive loss with optional hard negatives (supervised SimCSE)."""

    def __init__(self, temperature: float = 0.05, hard_negative_weight: float = 0.0) -> None:
        super().__init__()
        self.temperature = temperature
        self.hard_negative_weight = hard_negative_weight

    def forward(
        self, anchors: Tensor, positives: Tensor, labels: Tensor, hard_negatives: Tensor | None = None,
        drop: Tensor | None = None,
    ) -> Tensor:
        """`hard_negatives`: one or more blocks of `positives`' size (`hard_negative_bias`); `drop`:
        (n, columns) bool over the positives then the hard negatives (see `info_nce`)."""
        if hard_negatives is None:
            return info_nce(anchors, positives, labels, self.temperature, drop=drop)
        per_anchor = hard_negatives.size(0) // positives.size(0)
        bias = hard_negative_bias(labels, positives.size(0), self.hard_negative_weight, per_anchor)
        return info_nce(anchors, torch.cat([positives, hard_negatives]), labels, self.temperature, bias, drop)

    def own_candidates(self, anchors: Tensor, candidates: Tensor, drop: Tensor | None = None) -> Tensor:
        """The loss without in-batch negatives (a dataset's `in_batch_negatives: false`, BGE's): anchor i
        against its own candidates (n, c, d) only, its positive then its c - 1 hard negatives (biased
        by `hard_negative_weight`); `drop` (n, c) as in `info_nce`."""
        logits = own_cosines(anchors, candidates) / self.temperature
        logits[:, 1:] += self.hard_negative_weight
        if drop is not None:
            logits = logits.masked_fill(drop, float("-inf"))
        return F.cross_entropy(logits, logits.new_zeros(logits.size(0), dtype=torch.long))

    def get_config_dict(self) -> dict[str, float]:
        return {"temperature": self.temperature, "hard_negative_weight": self.hard_negative_weight}
