"""SNCSE's loss against its equations written out one anchor at a time (fp64, 1e-6: value and every
gradient), on inputs that put soft negatives on both sides of the margins; DDP's local rows against
global columns; one margin function shared with ClusterNS."""

from __future__ import annotations

import math

import torch

from lightning_sentemb.losses import clusterns, sncse
from lightning_sentemb.losses.margin import bidirectional_margin_loss
from lightning_sentemb.losses.sncse import SNCSELoss

TAU, LAMBDA, ALPHA, BETA = 0.05, 0.5, 0.1, 0.3  # λ large, so the BML's share of the gradient shows


def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """6 anchors, their positives and soft negatives; Δ_i above -α, inside [-β, -α] and below -β."""
    generator = torch.Generator().manual_seed(0)
    anchors = torch.randn(6, 8, generator=generator, dtype=torch.float64)
    positives = anchors + 0.3 * torch.randn(6, 8, generator=generator, dtype=torch.float64)
    scale = torch.tensor([0.05, 0.1, 0.6, 0.8, 1.5, 3.0], dtype=torch.float64)[:, None]
    soft = anchors + scale * torch.randn(6, 8, generator=generator, dtype=torch.float64)
    return anchors, positives, soft


def cos(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return (u @ v) / (u.norm() * v.norm())


def paper_loss(anchors: torch.Tensor, positives: torch.Tensor, soft: torch.Tensor, labels: list[int]) -> torch.Tensor:
    """L = -1/n Σ_i log(e^{cos(h_i, h_i^+)/τ} / Σ_j e^{cos(h_i, h_j^+)/τ}) + λ/n Σ_i [max(0, Δ_i + α) +
    max(0, -Δ_i - β)], Δ_i = cos(h_i, h_i^sn) - cos(h_i, h_i^+), one anchor at a time."""
    n = anchors.shape[0]
    total = anchors.new_zeros(())
    for i in range(n):
        denominator = sum(torch.exp(cos(anchors[i], positives[j]) / TAU) for j in range(positives.shape[0]))
        total = total - torch.log(torch.exp(cos(anchors[i], positives[labels[i]]) / TAU) / denominator) / n
        delta = cos(anchors[i], soft[i]) - cos(anchors[i], positives[labels[i]])
        total = total + LAMBDA * (torch.clamp(delta + ALPHA, min=0) + torch.clamp(-delta - BETA, min=0)) / n
    return total


def gradients(loss_of, *tensors: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [t.clone().requires_grad_() for t in tensors]
    loss = loss_of(*leaves)
    return loss.detach(), list(torch.autograd.grad(loss, leaves))


def test_inputs_exercise_both_margins() -> None:
    anchors, positives, soft = inputs()
    deltas = [float(cos(a, s) - cos(a, p)) for a, p, s in zip(anchors, positives, soft, strict=True)]
    assert max(deltas) > -ALPHA and min(deltas) < -BETA and any(-BETA < d < -ALPHA for d in deltas)


def test_loss_and_gradients_equal_the_paper_equations() -> None:
    anchors, positives, soft = inputs()
    labels = torch.arange(6)
    loss_fn = SNCSELoss(TAU, LAMBDA, ALPHA, BETA)
    ours, our_grads = gradients(lambda a, p, s: loss_fn(a, p, labels, s)[0], anchors, positives, soft)
    expected, expected_grads = gradients(lambda a, p, s: paper_loss(a, p, s, labels.tolist()), anchors, positives, soft)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)
    for got, want in zip(our_grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert our_grads[2].abs().sum() > 0  # the soft negatives receive gradient (through the BML only)


def test_the_reference_computation_with_its_library_calls() -> None:
    """SNCSE's `cl_forward`: CrossEntropyLoss over CosineSimilarity / τ, then the BML from
    `torch.cosine_similarity`, mean over the batch, times λ."""
    anchors, positives, soft = inputs()
    logits = torch.nn.CosineSimilarity(dim=-1)(anchors[:, None], positives[None]) / TAU
    reference = torch.nn.CrossEntropyLoss()(logits, torch.arange(6))
    temp = torch.cosine_similarity(anchors, soft, dim=1) - torch.cosine_similarity(anchors, positives, dim=1)
    reference = reference + LAMBDA * torch.mean(torch.relu(temp + ALPHA) + torch.relu(-temp - BETA))
    loss, stats = SNCSELoss(TAU, LAMBDA, ALPHA, BETA)(anchors, positives, torch.arange(6), soft)
    assert math.isclose(float(loss), float(reference), rel_tol=1e-9)
    assert math.isclose(float(stats["loss/info_nce"] + LAMBDA * stats["loss/bml"]), float(loss), rel_tol=1e-12)


def test_local_anchors_against_global_columns() -> None:
    """Rank 1 of 2 under DDP: anchors 3-5 against all six positives (labels 3, 4, 5): the loss of the
    global batch is the mean of the two ranks' losses."""
    anchors, positives, soft = inputs()
    loss_fn = SNCSELoss(TAU, LAMBDA, ALPHA, BETA)
    ranks = [loss_fn(anchors[r * 3 : r * 3 + 3], positives, torch.arange(3) + 3 * r, soft[r * 3 : r * 3 + 3])[0]
             for r in range(2)]
    whole = loss_fn(anchors, positives, torch.arange(6), soft)[0]
    torch.testing.assert_close((ranks[0] + ranks[1]) / 2, whole, rtol=1e-12, atol=0)


def test_one_margin_function_for_sncse_and_clusterns() -> None:
    assert sncse.bidirectional_margin_loss is clusterns.bidirectional_margin_loss is bidirectional_margin_loss
