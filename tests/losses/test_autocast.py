"""Every loss, the ClusterNS assignment and its centroid update give their fp32 values under bf16 autocast:
the similarities are computed with autocast and TF32 off (`precision.exact_fp32`), not recast to bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_sentemb.callbacks.kmeans import assign, update_centroids
from lightning_sentemb.losses.clusterns import ClusterNSLoss
from lightning_sentemb.losses.dclr import dclr_loss, harder_noise
from lightning_sentemb.losses.energy_hinge import InfoNCEHingeLoss
from lightning_sentemb.losses.info_nce import InfoNCELoss, info_nce
from lightning_sentemb.losses.mixcse import MixCSELoss, mixing_partners
from lightning_sentemb.losses.nli_softmax import NLISoftmaxLoss
from lightning_sentemb.losses.nt_xent import nt_xent
from lightning_sentemb.losses.sncse import SNCSELoss
from lightning_sentemb.precision import exact_fp32

N, DIM, K = 64, 48, 6


def inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    anchors = torch.randn(N, DIM, generator=generator)
    return {
        "anchors": anchors.to(dtype),
        "positives": (anchors + 2.0 * torch.randn(N, DIM, generator=generator)).to(dtype),
        "hard_negatives": torch.randn(N, DIM, generator=generator).to(dtype),
        "centroids": torch.randn(K, DIM, generator=generator),
    }


def bf16_autocast() -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def clusterns_loss(false_negatives: str):
    def loss(x: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        clusters = assign(x["positives"], x["centroids"])
        value, _ = ClusterNSLoss(false_negatives=false_negatives, bml_weight=1.0)(
            x["anchors"], x["positives"], labels, x["centroids"], clusters.nearest, clusters.second_nearest)
        return value

    return loss


def dclr(objective: str):
    def loss(x: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        drop = (torch.arange(N)[:, None] + torch.arange(N)[None, :]) % 3 == 1
        noise = harder_noise(x["hard_negatives"], x["anchors"], x["positives"], labels, 2, 0.1, 0.05, objective)
        return dclr_loss(x["anchors"], x["positives"], noise, labels, 0.05, drop, objective)

    return loss


LOSSES = {
    # SimCSE, PromptBERT (template views), DCPCSE unsupervised
    "info_nce": lambda x, labels: InfoNCELoss()(x["anchors"], x["positives"], labels),
    # supervised SimCSE, ConPVP (negative prototypes as hard negatives, weight 0)
    "info_nce_hard_negatives": lambda x, labels: InfoNCELoss(hard_negative_weight=0.0)(
        x["anchors"], x["positives"], labels, x["hard_negatives"]),
    # supervised DCPCSE
    "energy_hinge": lambda x, labels: InfoNCEHingeLoss()(x["anchors"], x["positives"], labels, x["hard_negatives"]),
    # ClusterNS before clustering starts, then with centroids in each false-negative mode
    "clusterns_plain": lambda x, labels: ClusterNSLoss()(x["anchors"], x["positives"], labels)[0],
    **{f"clusterns_{mode}": clusterns_loss(mode) for mode in ("bml", "mask", "positive", "none")},
    # ConSERT: both views anchors, both views negatives
    "nt_xent": lambda x, labels: nt_xent(x["anchors"], x["positives"], x["anchors"], x["positives"], labels, 0.1),
    # SNCSE (hard negatives as the soft negatives, a λ that shows the BML), SBERT's classifier
    "sncse": lambda x, labels: SNCSELoss(bml_weight=1.0)(x["anchors"], x["positives"], labels, x["hard_negatives"])[0],
    "sbert": lambda x, labels: sbert_loss(x["anchors"], x["positives"], labels % 3),
    # DCLR: the noise moved by gradient ascent under autocast too, a third of the in-batch negatives dropped
    **{f"dclr_{objective}": dclr(objective) for objective in ("paper", "reference")},
    # ESimCSE: the queue's keys as extra columns, its unfilled rows dropped
    "esimcse_queue": lambda x, labels: info_nce(x["anchors"], torch.cat([x["positives"], x["hard_negatives"]]), labels,
                                                drop=torch.arange(2 * N)[None].expand(N, -1) >= 2 * N - 3),
    # MixCSE's mixed negatives, the paper's layout (2 each) and the reference's
    "mixcse": lambda x, labels: MixCSELoss().paper(x["anchors"], x["positives"], labels,
                                                   mixing_partners(N, 2, "next", None, labels.device)),
    "mixcse_reference": lambda x, labels: MixCSELoss().reference(x["anchors"], x["positives"], x["anchors"], labels),
}


def sbert_loss(u: torch.Tensor, v: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(0)  # the classifier's initial weights
    return NLISoftmaxLoss(DIM)(u, v, labels)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-inputs", "bf16-inputs"])
@pytest.mark.parametrize("name", LOSSES)
def test_loss_under_bf16_autocast_equals_fp32(name, dtype):
    x, labels = inputs(dtype), torch.arange(N)
    expected = LOSSES[name](x, labels)
    with bf16_autocast():
        got = LOSSES[name](x, labels)
    assert got.dtype == torch.float32
    assert abs(got.item() - expected.item()) <= 1e-5, (got.item(), expected.item())


def test_plain_matmul_under_autocast_is_bf16_so_the_test_can_fail():
    """What the losses computed before: the product under autocast, even of fp32 inputs, is bf16."""
    x, labels = inputs(torch.float32), torch.arange(N)
    a, b = F.normalize(x["anchors"], dim=-1), F.normalize(x["positives"], dim=-1)
    exact = a @ b.T
    with bf16_autocast():
        rounded = a @ b.T
    assert rounded.dtype == torch.bfloat16
    assert (rounded.float() - exact).abs().max() > 1e-4
    loss_gap = F.cross_entropy(rounded.float() / 0.05, labels) - F.cross_entropy(exact / 0.05, labels)
    assert loss_gap.abs() > 1e-4


def test_cluster_assignment_and_update_under_bf16_autocast_equal_fp32():
    x = inputs(torch.float32)
    expected = assign(x["anchors"], x["centroids"])
    expected_centroids = update_centroids(x["centroids"].clone(), x["anchors"], expected.nearest, 0.5)
    with bf16_autocast():
        got = assign(x["anchors"], x["centroids"])
        got_centroids = update_centroids(x["centroids"].clone(), x["anchors"], got.nearest, 0.5)
    assert torch.equal(got.nearest, expected.nearest) and torch.equal(got.second_nearest, expected.second_nearest)
    assert torch.allclose(got.sims, expected.sims, atol=1e-6, rtol=0)
    assert torch.allclose(got_centroids, expected_centroids, atol=1e-6, rtol=0)
    with bf16_autocast():  # the centroid update's one-hot product would be bf16 too without the guard
        assert (torch.ones(K, N) @ x["anchors"]).dtype == torch.bfloat16


def test_exact_fp32_restores_the_matmul_precision():
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        with exact_fp32("cpu"):
            assert torch.get_float32_matmul_precision() == "highest"
            assert not torch.is_autocast_enabled("cpu")
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(previous)


def test_the_shared_cosine_steps_stay_fp32_and_equal_the_matrix():
    """`paired_cosine` (SNCSE's pairs, MixCSE's mixes, broadcast) and `contrastive_logits` (every InfoNCE's
    logits) read their cosines as `cosine_matrix` does: fp32 under bf16 autocast, and the same values."""
    from lightning_sentemb.losses.info_nce import contrastive_logits, cosine_matrix, paired_cosine

    generator = torch.Generator().manual_seed(0)
    anchors, mixes = torch.randn(4, 16, generator=generator), torch.randn(4, 3, 16, generator=generator)
    drop = torch.zeros(4, 4, dtype=torch.bool)
    drop[0, 2] = True
    with torch.autocast("cpu", dtype=torch.bfloat16):
        paired = paired_cosine(anchors[:, None], mixes.bfloat16())
        logits = contrastive_logits(anchors.bfloat16(), anchors, 0.05, drop=drop)
    assert paired.dtype == logits.dtype == torch.float32 and paired.shape == (4, 3)
    by_row = torch.stack([cosine_matrix(anchors[i, None], mixes[i].bfloat16())[0] for i in range(4)])
    torch.testing.assert_close(paired, by_row, rtol=1e-6, atol=1e-6)
    want = cosine_matrix(anchors.bfloat16(), anchors) / 0.05
    assert logits[0, 2] == float("-inf")
    torch.testing.assert_close(logits[~drop], want[~drop], rtol=1e-6, atol=1e-5)
