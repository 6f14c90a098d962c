"""ClusterNS loss against explicit-loop formulas (Eq. 1-6), its ablation switches, DDP-style
local rows vs global columns, diagnostics, and equivalence with the shared InfoNCE."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_sentemb.callbacks.kmeans import assign
from lightning_sentemb.losses.clusterns import ClusterNSLoss
from lightning_sentemb.losses.info_nce import InfoNCELoss
from lightning_sentemb.losses.margin import bidirectional_margin_loss

TAU, MU, LAMBDA, ALPHA, BETA = 0.05, 1.5, 0.3, 0.1, 0.3
NEAREST = torch.tensor([0, 0, 1, 2, 1, 0])
SECOND = torch.tensor([1, 2, 0, 0, 2, 1])


def _inputs() -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    anchors = torch.randn(6, 8, generator=generator, dtype=torch.float64)
    positives = anchors + 0.7 * torch.randn(6, 8, generator=generator, dtype=torch.float64)
    positives[1] = anchors[0] + 0.05 * torch.randn(8, generator=generator, dtype=torch.float64)
    centroids = torch.randn(3, 8, generator=generator, dtype=torch.float64)
    return anchors, positives, centroids


def _cos(u: Tensor, v: Tensor) -> float:
    return float(u @ v / (u.norm() * v.norm()))


def reference_loss(
    anchors: Tensor,
    positives: Tensor,
    labels: list[int],
    centroids: Tensor,
    nearest: list[int],
    second: list[int],
    hard_negatives: str,
    false_negatives: str,
    bml_reduction: str,
) -> float:
    """Eq. 2-6 written out with loops, one anchor and one column at a time."""
    n, m = len(labels), positives.shape[0]
    total, bml_sum, bml_pairs = 0.0, 0.0, 0
    for i in range(n):
        own = labels[i]
        fns = [j for j in range(m) if j != own and nearest[j] == nearest[own]]
        denominator = 0.0
        for j in range(m):
            if false_negatives == "mask" and j in fns:
                continue
            denominator += math.exp(_cos(anchors[i], positives[j]) / TAU)
        if hard_negatives != "none":
            for j in range(m):
                hard = centroids[second[j] if hard_negatives == "second_nearest" else nearest[j]]
                denominator += MU * math.exp(_cos(anchors[i], hard) / TAU)
        numerator = math.exp(_cos(anchors[i], positives[own]) / TAU)
        if false_negatives == "positive":
            numerator += sum(math.exp(_cos(anchors[i], positives[j]) / TAU) for j in fns)
        total += -math.log(numerator / denominator)
        if false_negatives == "bml":
            for j in fns:
                delta = _cos(anchors[i], positives[j]) - _cos(anchors[i], positives[own])
                bml_sum += max(0.0, delta + ALPHA) + max(0.0, -delta - BETA)
                bml_pairs += 1
    loss = total / n
    if false_negatives == "bml":
        loss += LAMBDA * bml_sum / (max(bml_pairs, 1) if bml_reduction == "false_negatives" else n * m)
    return loss


def _cosines(a: Tensor, b: Tensor) -> Tensor:
    return F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T


def _loss(**switches: str) -> ClusterNSLoss:
    return ClusterNSLoss(TAU, MU, LAMBDA, ALPHA, BETA, **switches)


CASES = list(
    itertools.product(
        ("second_nearest", "nearest", "none"), ("bml", "mask", "positive", "none"), ("false_negatives", "all_pairs")
    )
)


@pytest.mark.parametrize(("hard_negatives", "false_negatives", "bml_reduction"), CASES)
def test_loss_matches_loop_reference(hard_negatives: str, false_negatives: str, bml_reduction: str):
    anchors, positives, centroids = _inputs()
    labels = torch.arange(6)
    loss_fn = _loss(hard_negatives=hard_negatives, false_negatives=false_negatives, bml_reduction=bml_reduction)
    loss, _ = loss_fn(anchors, positives, labels, centroids, NEAREST, SECOND)
    expected = reference_loss(
        anchors, positives, labels.tolist(), centroids, NEAREST.tolist(), SECOND.tolist(),
        hard_negatives, false_negatives, bml_reduction,
    )
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_example_exercises_both_margins():
    # Guard for the test above: some false-negative Δ is above -α, some below -β.
    anchors, positives, _ = _inputs()
    deltas = []
    for i in range(6):
        for j in range(6):
            if j != i and NEAREST[j] == NEAREST[i]:
                deltas.append(_cos(anchors[i], positives[j]) - _cos(anchors[i], positives[i]))
    assert max(deltas) > -ALPHA and min(deltas) < -BETA


def test_bml_formula_and_signs():
    sim_pos = torch.tensor(0.9)
    # Δ = 0 (too close): α; Δ = -0.2 (inside [-β, -α]): 0; Δ = -0.6 (too far): 0.6 - β.
    sim_false_neg = torch.tensor([0.9, 0.7, 0.3])
    losses = bidirectional_margin_loss(sim_false_neg, sim_pos, ALPHA, BETA, reduction="none")
    torch.testing.assert_close(losses, torch.tensor([ALPHA, 0.0, 0.6 - BETA]))
    mean = bidirectional_margin_loss(sim_false_neg, sim_pos, ALPHA, BETA)
    total = bidirectional_margin_loss(sim_false_neg, sim_pos, ALPHA, BETA, reduction="sum")
    assert mean.item() == pytest.approx((ALPHA + 0.3) / 3) and total.item() == pytest.approx(ALPHA + 0.3)


def test_hard_negative_is_second_nearest_centroid():
    anchors, positives, centroids = _inputs()
    nearest, second, _ = assign(anchors, centroids)
    labels = torch.arange(6)
    loss_fn = _loss(false_negatives="none")
    loss, _ = loss_fn(anchors, positives, labels, centroids, nearest, second)
    # Same loss as a cross-entropy whose extra columns are explicitly the second-nearest centroids.
    logits = torch.cat([_cosines(anchors, positives), _cosines(anchors, centroids[second])], dim=1) / TAU
    logits[:, 6:] += math.log(MU)
    expected = F.cross_entropy(logits, labels)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    # A centroid that is nobody's second-nearest does not enter the loss.
    unused = sorted(set(range(3)) - set(second.tolist()))
    moved = centroids.clone()
    moved[unused] = torch.randn(len(unused), 8, dtype=torch.float64)
    assert loss_fn(anchors, positives, labels, moved, nearest, second)[0].item() == pytest.approx(loss.item())


def test_equivalent_to_shared_info_nce():
    anchors, positives, centroids = _inputs()
    labels = torch.arange(6)
    plain, _ = ClusterNSLoss(temperature=TAU)(anchors, positives, labels)
    assert plain.item() == pytest.approx(InfoNCELoss(TAU)(anchors, positives, labels).item(), rel=1e-6)
    # With μ = 1 every hard-negative column has weight 1, SimCSE's logit weight 0 alike.
    loss_fn = ClusterNSLoss(TAU, hard_negative_weight=1.0, false_negatives="none")
    ours, _ = loss_fn(anchors, positives, labels, centroids, NEAREST, SECOND)
    shared = InfoNCELoss(TAU, hard_negative_weight=0.0)(anchors, positives, labels, centroids[SECOND])
    assert ours.item() == pytest.approx(shared.item(), rel=1e-6)


def test_ablation_switches_move_the_loss_as_expected():
    anchors, positives, centroids = _inputs()
    labels = torch.arange(6)

    def value(**switches) -> float:
        return _loss(**switches)(anchors, positives, labels, centroids, NEAREST, SECOND)[0].item()

    base = value(false_negatives="none")
    assert value(false_negatives="none", hard_negatives="none") < base  # fewer denominator terms
    assert value(false_negatives="mask") < base  # false negatives leave the denominator
    assert value(false_negatives="positive") < value(false_negatives="mask")  # ... and join the numerator
    assert value(false_negatives="bml") > base  # + λ · BML ≥ 0, > 0 here
    bml = {
        reduction: _loss(bml_reduction=reduction)(anchors, positives, labels, centroids, NEAREST, SECOND)[1]
        for reduction in ("false_negatives", "all_pairs")
    }
    pairs = sum(int(NEAREST[j] == NEAREST[i]) for i in range(6) for j in range(6) if i != j)
    per_pair, per_entry = bml["false_negatives"]["loss/bml"].item(), bml["all_pairs"]["loss/bml"].item()
    assert per_entry == pytest.approx(per_pair * pairs / 36, rel=1e-6)
    # Nearest centroid is more similar than the second-nearest when ids come from `assign`.
    nearest, second, _ = assign(anchors, centroids)
    near, far = (
        _loss(hard_negatives=mode, false_negatives="none")(anchors, positives, labels, centroids, nearest, second)[0]
        for mode in ("nearest", "second_nearest")
    )
    assert near.item() > far.item()


def test_local_rows_against_global_columns():
    # Under DDP each rank has its rows and all columns; the two halves average to the full loss.
    anchors, positives, centroids = _inputs()
    loss_fn = _loss(false_negatives="mask")
    full, _ = loss_fn(anchors, positives, torch.arange(6), centroids, NEAREST, SECOND)
    halves = [
        loss_fn(anchors[rows], positives, torch.arange(6)[rows], centroids, NEAREST, SECOND)[0]
        for rows in (slice(0, 3), slice(3, 6))
    ]
    assert ((halves[0] + halves[1]) / 2).item() == pytest.approx(full.item(), rel=1e-6)
    loss_fn = _loss()
    rank1, _ = loss_fn(anchors[3:], positives, torch.arange(3, 6), centroids, NEAREST, SECOND)
    expected = reference_loss(
        anchors[3:], positives, [3, 4, 5], centroids, NEAREST.tolist(), SECOND.tolist(),
        "second_nearest", "bml", "all_pairs",
    )
    assert rank1.item() == pytest.approx(expected, rel=1e-5)


def test_diagnostics_match_hand_computation():
    anchors, positives, centroids = _inputs()
    labels = torch.arange(6)
    _, stats = _loss()(anchors, positives, labels, centroids, NEAREST, SECOND)
    sim = _cosines(anchors, positives)
    same = (NEAREST[:, None] == NEAREST[None, :]) & ~torch.eye(6, dtype=torch.bool)
    to_centroids = _cosines(anchors, centroids)
    between = _cosines(centroids, centroids)
    expected = {
        "sim/positive": sim.diagonal().mean(),
        "sim/in_batch_negative": sim[~torch.eye(6, dtype=torch.bool)].mean(),
        "sim/intra_cluster": sim[same].mean(),
        "sim/sample_centroid": to_centroids[torch.arange(6), NEAREST].mean(),
        "sim/hard_negative": to_centroids[torch.arange(6), SECOND].mean(),
        "sim/inter_centroid": between[~torch.eye(3, dtype=torch.bool)].mean(),
        "false_negative/pair_rate": same.double().sum() / 30,  # 8 ordered pairs of 30
        "false_negative/sample_rate": same.any(dim=1).double().mean(),  # the lone cluster-2 sample has none
    }
    for key, value in expected.items():
        assert stats[key].item() == pytest.approx(value.item(), rel=1e-5), key
    assert stats["false_negative/pair_rate"].item() == pytest.approx(8 / 30)
    assert stats["false_negative/sample_rate"].item() == pytest.approx(5 / 6)
    assert {"loss/info_nce", "loss/bml"} <= set(stats)
    assert all(not value.requires_grad for value in stats.values())


def test_gradients_reach_anchors_and_positives_only():
    anchors, positives, centroids = (t.float() for t in _inputs())
    anchors.requires_grad_()
    positives.requires_grad_()
    loss, _ = ClusterNSLoss()(anchors, positives, torch.arange(6), centroids, NEAREST, SECOND)
    loss.backward()
    assert anchors.grad is not None and anchors.grad.abs().sum() > 0
    assert positives.grad is not None and positives.grad.abs().sum() > 0


def test_config_round_trip_and_validation():
    loss_fn = ClusterNSLoss(0.1, 2.0, 1e-3, 0.0, 0.3, "nearest", "mask", "false_negatives")
    assert ClusterNSLoss(**loss_fn.get_config_dict()).get_config_dict() == loss_fn.get_config_dict()
    with pytest.raises(ValueError, match="alpha <= beta"):
        ClusterNSLoss(bml_alpha=0.5, bml_beta=0.2)
    with pytest.raises(ValueError, match="hard_negatives"):
        ClusterNSLoss(hard_negatives="farthest")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="false_negatives"):
        ClusterNSLoss(false_negatives="drop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="μ"):
        ClusterNSLoss(hard_negative_weight=0.0)
    anchors, positives, centroids = _inputs()
    with pytest.raises(ValueError, match="nearest"):
        ClusterNSLoss()(anchors, positives, torch.arange(6), centroids)


def test_loss_runs_without_host_reads(monkeypatch: pytest.MonkeyPatch):
    anchors, positives, centroids = (t.float() for t in _inputs())

    def boom(*args, **kwargs):
        raise AssertionError("host sync")

    for false_negatives in ("bml", "mask", "positive"):
        loss_fn = _loss(false_negatives=false_negatives)
        with monkeypatch.context() as patch:
            for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
                patch.setattr(torch.Tensor, name, boom)
            loss_fn(anchors, positives, torch.arange(6), centroids, NEAREST, SECOND)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for sync debug mode")
def test_loss_runs_without_cuda_sync():
    anchors, positives, centroids = (t.float().cuda() for t in _inputs())
    anchors.requires_grad_()
    labels, nearest, second = torch.arange(6).cuda(), NEAREST.cuda(), SECOND.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for false_negatives in ("bml", "mask", "positive"):
            loss_fn = _loss(false_negatives=false_negatives)
            loss, _ = loss_fn(anchors, positives, labels, centroids, nearest, second)
            loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
