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
from torch import Tensor

from ..precision import exact_fp32
from .info_nce import cosine_matrix

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


def row_cosines(anchors: Tensor, mixed: Tensor) -> Tensor:
    """(n, k) cos(anchors[i], mixed[i, k]), in fp32 or wider under any autocast."""
    dtype = torch.promote_types(torch.promote_types(anchors.dtype, mixed.dtype), torch.float32)
    with exact_fp32(anchors.device.type):
        return (F.normalize(mixed.to(dtype), dim=-1) @ F.normalize(anchors.to(dtype), dim=-1)[:, :, None])[..., 0]


def mix(first: Tensor, second: Tensor, lam: float, stop_gradient: bool) -> Tensor:
    """λ·first + (1 − λ)·second, detached under stop-gradient."""
    mixed = lam * first + (1 - lam) * second
    return mixed.detach() if stop_gradient else mixed


def mixcse_loss(
    anchors: Tensor,
    positives: Tensor,
    labels: Tensor,
    partners: Tensor,
    lam: float = 0.2,
    temperature: float = 0.05,
    stop_gradient: bool = True,
    drop: Tensor | None = None,
) -> Tensor:
    """The paper's layout: anchor i (row of `anchors`, its positive at column `labels[i]` of the global
    `positives`) against every positive and its own mixes λ·positives[labels[i]] + (1 − λ)·positives[p]
    for p in `partners[i]` (n, k). `drop` (n, positives) leaves in-batch negatives out (`losses.guide`)."""
    mixed = mix(positives[labels][:, None], positives[partners], lam, stop_gradient)  # (n, k, d)
    in_batch = cosine_matrix(anchors, positives) / temperature
    if drop is not None:
        in_batch = in_batch.masked_fill(drop, float("-inf"))
    return F.cross_entropy(torch.cat([in_batch, row_cosines(anchors, mixed) / temperature], dim=1), labels)


def reference_mixcse_loss(
    anchors: Tensor,
    positives: Tensor,
    all_anchors: Tensor,
    labels: Tensor,
    lam: float = 0.2,
    temperature: float = 0.05,
    stop_gradient: bool = True,
    drop: Tensor | None = None,
) -> Tensor:
    """The reference's layout (module docstring); `all_anchors`: the global batch's anchors, as `positives`."""
    total = positives.size(0)
    columns = torch.arange(total, device=labels.device)[None]
    mixed_positives = mix(positives, positives.roll(-1, 0), lam, stop_gradient)
    mixed_anchors = mix(all_anchors, all_anchors.roll(-1, 0), lam, stop_gradient)[labels]
    in_batch = cosine_matrix(anchors, positives) / temperature
    if drop is not None:
        in_batch = in_batch.masked_fill(drop, float("-inf"))
    block1 = (cosine_matrix(anchors, mixed_positives) / temperature).masked_fill(
        columns == (labels[:, None] - 1) % total, 0.0)
    block2 = (cosine_matrix(mixed_anchors, positives) / temperature).masked_fill(
        columns == (labels[:, None] + 1) % total, 0.0)
    return F.cross_entropy(torch.cat([in_batch, block1, block2], dim=1), labels)
