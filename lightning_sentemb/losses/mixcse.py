"""MixCSE's loss (Zhang et al., AAAI 2022, "Unsupervised Sentence Representation via Contrastive Learning
with Mixing Negatives"; reference BDBC-KG-NLP/MixCSE_AAAI2022, mixcse/models_mix.py): SimCSE's InfoNCE with
hard negatives made by mixing an anchor's positive with an in-batch negative,

    h̃ = (λ·h⁺_i + (1 − λ)·h⁻_j) / ‖λ·h⁺_i + (1 − λ)·h⁻_j‖,

added to the anchor's denominator, with stop-gradient (the mix is a constant of the loss). Two layouts:

- "paper" (default): anchor i's denominator gains its own mixed negatives only, one per chosen partner j
  (`num_mixed` of them; the in-batch negatives are the other sentences' positives);
- "reference": what the reference's loss computes. Every anchor sees every sentence's mix with the next
  sentence, m_j = λ·h⁺_j + (1 − λ)·h⁺_{j+1}, the one made of 1 − λ of its own positive (j = i − 1) put at
  logit 0 (the reference multiplies that logit by 0, so it still adds e⁰ to the denominator); and a
  second block: the anchors mixed the same way, u_i = λ·h_i + (1 − λ)·h_{i+1}, scored against every
  positive (row i: cos(u_i, h⁺_j)/τ, j = i + 1 at logit 0).

The cosine normalizes, so h̃'s normalization changes no value; without stop-gradient it is part of the
graph all the same. Similarities in fp32 under any autocast (`info_nce.cosine_matrix`).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .info_nce import contrastive_logits, cosine_matrix, paired_cosine

MixLayout = Literal["paper", "reference"]
MixWith = Literal["random", "next"]


def mixing_partners(total: int, num_mixed: int, choose: MixWith, generator: torch.Generator | None,
                    device: torch.device) -> Tensor:
    """(total, num_mixed) for each row of the global batch, the other rows whose positives its positive is mixed
    with, all distinct: "next" the following ones (i + 1, i + 2, … cyclically, the reference's partner for
    one), "random" drawn uniformly without replacement from `generator` (on `device`)."""
    if not 0 < num_mixed < total:
        raise ValueError(f"num_mixed must be between 1 and the global batch less one ({total - 1}), got {num_mixed}")
    rows = torch.arange(total, device=device)[:, None]
    if choose == "next":
        offsets = torch.arange(1, num_mixed + 1, device=device)[None]
    else:
        offsets = 1 + torch.rand(total, total - 1, generator=generator, device=device).argsort(dim=1)[:, :num_mixed]
    return (rows + offsets) % total


def mix(first: Tensor, second: Tensor, lam: float, stop_gradient: bool) -> Tensor:
    """λ·first + (1 − λ)·second, detached under stop-gradient."""
    mixed = lam * first + (1 - lam) * second
    return mixed.detach() if stop_gradient else mixed


class MixCSELoss(nn.Module):
    """InfoNCE with mixed negatives in either layout (module docstring): λ (`lam`), τ and stop-gradient in
    the constructor, as sentence-transformers' losses; `paper` and `reference` compute the two layouts.
    Every call: anchors (n, d) of this rank, `positives` (m, d) of the global batch, `labels[i]` the column
    of anchor i's positive, `drop` (n, m) the in-batch negatives left out (`losses.guide`)."""

    def __init__(self, lam: float = 0.2, temperature: float = 0.05, stop_gradient: bool = True) -> None:
        super().__init__()
        self.lam = lam
        self.temperature = temperature
        self.stop_gradient = stop_gradient

    def paper(self, anchors: Tensor, positives: Tensor, labels: Tensor, partners: Tensor,
              drop: Tensor | None = None) -> Tensor:
        """Anchor i against every positive and its own mixes λ·positives[labels[i]] + (1 − λ)·positives[p] for
        p in `partners[i]` (n, k)."""
        mixed = mix(positives[labels][:, None], positives[partners], self.lam, self.stop_gradient)  # (n, k, d)
        in_batch = contrastive_logits(anchors, positives, self.temperature, drop=drop)
        logits = [in_batch, paired_cosine(anchors[:, None], mixed) / self.temperature]  # (n, k) own mixes
        return F.cross_entropy(torch.cat(logits, dim=1), labels)

    def reference(self, anchors: Tensor, positives: Tensor, all_anchors: Tensor, labels: Tensor,
                  drop: Tensor | None = None) -> Tensor:
        """The reference's layout; `all_anchors`: the global batch's anchors, in the positives' order."""
        total, lam, tau = positives.size(0), self.lam, self.temperature
        columns = torch.arange(total, device=labels.device)[None]
        mixed_positives = mix(positives, positives.roll(-1, 0), lam, self.stop_gradient)
        mixed_anchors = mix(all_anchors, all_anchors.roll(-1, 0), lam, self.stop_gradient)[labels]
        own_in_mix = (cosine_matrix(anchors, mixed_positives) / tau).masked_fill(
            columns == (labels[:, None] - 1) % total, 0.0)
        mixed_anchor = (cosine_matrix(mixed_anchors, positives) / tau).masked_fill(
            columns == (labels[:, None] + 1) % total, 0.0)
        logits = [contrastive_logits(anchors, positives, tau, drop=drop), own_in_mix, mixed_anchor]
        return F.cross_entropy(torch.cat(logits, dim=1), labels)

    def get_config_dict(self) -> dict[str, float | bool]:
        return {"lam": self.lam, "temperature": self.temperature, "stop_gradient": self.stop_gradient}
