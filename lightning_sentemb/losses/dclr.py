"""DCLR's loss (Zhou et al., ACL 2022, "Debiased Contrastive Learning of Unsupervised Sentence
Representations"): noise-based negatives made harder by gradient ascent, and in-batch negatives weighted
0 or 1 by a complementary model (the weights arrive as `drop`, the guide's mask: `methods.dclr`).

With h_i an anchor, h_i⁺ its positive, {h̃⁻} the other in-batch rows and {ĥ} the noise negatives:

- Eq. 3, the non-uniformity loss: L_U = −log e^{sim(h_i, h_i⁺)/τ_u} / Σ_{ĥ_j} e^{sim(h_i, ĥ_j)/τ_u};
- Eq. 4, t steps of ĥ_j ← ĥ_j + β g/‖g‖₂ with g = ∇_{ĥ_j} L_U (gradient *ascent*: the noise moves
  towards the anchors, so the negatives get harder), starting from ĥ ~ N(0, σ²);
- Eq. 6, the debiased loss: −log e^{sim(h_i, h_i⁺)/τ} / Σ_{h⁻ ∈ {ĥ} ∪ {h̃⁻}} α_{h⁻} e^{sim(h_i, h⁻)/τ},
  the positive in the numerator only, α = 0 for a dropped in-batch negative, 1 otherwise (noise
  included).

`objective="reference"` is RUCAIBox/DCLR's code instead (simcse/models.py, `cl_vat_forward`): the noise
ascends SimCSE's cross-entropy over [in-batch columns, noise] at τ, and the loss is a binary
cross-entropy on the softmax of the weighted logits: p = softmax(w · s/τ) over every column (the
positive included, its weight 1; a dropped column's logit becomes 0, so it stays in the denominator as
e⁰), loss = −mean over all n × (columns) entries of [y log p + (1 − y) log(1 − p)].

The noise is a constant of the loss: its ascent reads the anchors and candidates detached (the paper's
g is a direction, as VAT's), so the model's gradient flows only through sim(h_i, ĥ_j).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from .info_nce import cosine_matrix

__all__ = ["Objective", "dclr_loss", "harder_noise"]

Objective = Literal["paper", "reference"]


def harder_noise(
    noise: Tensor, anchors: Tensor, candidates: Tensor, labels: Tensor, steps: int, step_size: float,
    temperature: float, objective: Objective = "paper",
) -> Tensor:
    """`noise` (k, d) after `steps` normalized gradient-ascent steps of `step_size` (Eq. 4), detached.

    `anchors` (n, d), `candidates` (m, d) (positives, then any hard negatives) and `labels` (n,) are the
    whole batch's (under DDP: gathered, so every rank moves the noise alike). "paper" ascends L_U (Eq. 3)
    at `temperature` (τ_u); "reference" the cross-entropy over [candidates, noise] at `temperature` (τ).
    """
    anchors, candidates = anchors.detach(), candidates.detach()
    noise = noise.to(torch.promote_types(noise.dtype, torch.float32))  # its steps are small: never in bf16
    with torch.enable_grad():
        for _ in range(steps):
            noise = noise.detach().requires_grad_()
            noise_logits = cosine_matrix(anchors, noise) / temperature
            if objective == "paper":
                positive = cosine_matrix(anchors, candidates).gather(1, labels[:, None])[:, 0] / temperature
                loss = (torch.logsumexp(noise_logits, dim=1) - positive).mean()
            else:
                logits = torch.cat([cosine_matrix(anchors, candidates) / temperature, noise_logits], dim=1)
                loss = F.cross_entropy(logits, labels)
            (gradient,) = torch.autograd.grad(loss, noise)
            noise = noise + step_size * F.normalize(gradient, dim=-1)
    return noise.detach()


def dclr_loss(
    anchors: Tensor, candidates: Tensor, noise: Tensor, labels: Tensor, temperature: float,
    drop: Tensor | None = None, objective: Objective = "paper",
) -> Tensor:
    """DCLR's loss of the local `anchors` (n, d) against `candidates` (m, d; `labels[i]` the column of
    anchor i's positive) and the `noise` negatives (k, d); `drop` (n, m): the in-batch columns of weight
    0. "paper": Eq. 6 (an anchor whose every negative is dropped, with no noise, has nothing to contrast
    and adds 0); "reference": the code's binary cross-entropy (module docstring)."""
    in_batch = cosine_matrix(anchors, candidates) / temperature
    logits = torch.cat([in_batch, cosine_matrix(anchors, noise) / temperature], dim=1)
    positive = labels[:, None] == torch.arange(logits.size(1), device=logits.device)  # one_hot reads labels back
    dropped = F.pad(drop, (0, noise.size(0))) if drop is not None else torch.zeros_like(positive)
    if objective == "paper":
        negatives = torch.logsumexp(logits.masked_fill(positive | dropped, float("-inf")), dim=1)
        terms = negatives - logits.gather(1, labels[:, None])[:, 0]
        return torch.where(negatives.isneginf(), torch.zeros_like(terms), terms).mean()
    log_p = torch.log_softmax(logits.masked_fill(dropped, 0.0), dim=1)
    # log(1 - p) of the negatives only: at the positive, p rounds to 1 in fp32 once the loss is below ~1e-7
    # (where the code's loss sits), and log1p(-1) = -inf would turn torch.where's zero gradient into NaN
    negatives = torch.log1p(-log_p.masked_fill(positive, float("-inf")).exp())
    return -torch.where(positive, log_p, negatives).mean()
