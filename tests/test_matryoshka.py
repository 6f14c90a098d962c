"""Matryoshka training for every method: on fixed embeddings the loss is the hand-written weighted sum
of the method's loss over truncated, re-normalized embeddings; the settings are checked; validation
and `sentemb evaluate --dims` score a truncation as encode → truncate → normalize."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_sentemb.callbacks.kmeans import assign
from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.losses.clusterns import ClusterNSLoss
from lightning_sentemb.losses.energy_hinge import InfoNCEHingeLoss
from lightning_sentemb.losses.info_nce import InfoNCELoss
from lightning_sentemb.matryoshka import truncate
from lightning_sentemb.methods import DCPCSE, ClusterNS, ClusterNSPrefix, ClusterNSPrompt, ConPVP, PromptBERT, SimCSE

DIMS, WEIGHTS = [32, 16, 8], [1.0, 0.5, 2.0]
N = 4  # sentences
MATRYOSHKA = {"matryoshka_dims": DIMS, "matryoshka_weights": WEIGHTS}


def cut(embeddings: torch.Tensor, dim: int) -> torch.Tensor:
    """The truncation written out: first `dim` columns over their norm."""
    prefix = embeddings[:, :dim]
    return prefix / prefix.norm(dim=1, keepdim=True)


def simcse_reference(loss, views: int):
    def reference(embeddings, method, dim):
        rows = cut(embeddings, dim).unflatten(0, (views, -1))
        return loss(rows[0], rows[1], torch.arange(N), rows[2] if views == 3 else None)
    return reference


def clusterns_reference(embeddings, method, dim):
    """ClusterNS's loss with clusters assigned at full size and the centroids truncated like the rows."""
    anchors_full = embeddings.unflatten(0, (2, -1))[0]
    centroids = method.cluster_state.centroids
    clusters = assign(anchors_full, centroids)
    rows = cut(embeddings, dim).unflatten(0, (2, -1))
    loss = ClusterNSLoss(0.05, 1.0, 1e-3, 0.0, 0.3)
    return loss(rows[0], rows[1], torch.arange(N), centroids[:, :dim] / centroids[:, :dim].norm(dim=1, keepdim=True),
                clusters.nearest, clusters.second_nearest)[0]


CASES = {
    "simcse": (lambda p: SimCSE(p, **MATRYOSHKA), 2, simcse_reference(InfoNCELoss(0.05), 2)),
    "simcse_sup": (lambda p: SimCSE(p, hard_negative_weight=0.5, **MATRYOSHKA), 3,
                   simcse_reference(InfoNCELoss(0.05, 0.5), 3)),
    "promptbert": (lambda p: PromptBERT(p, **MATRYOSHKA), 2, simcse_reference(InfoNCELoss(0.05), 2)),
    "conpvp": (lambda p: ConPVP(p, **MATRYOSHKA), 3, simcse_reference(InfoNCELoss(0.05), 3)),
    "dcpcse_sup_hinge": (lambda p: DCPCSE(p, prefix_len=2, hinge_weight=10.0, **MATRYOSHKA), 3,
                         simcse_reference(InfoNCEHingeLoss(0.05, 0.0, 0.2, 10.0), 3)),
    "clusterns": (lambda p: ClusterNS(p, num_clusters=2, **MATRYOSHKA), 2, clusterns_reference),
    "clusterns_prompt": (lambda p: ClusterNSPrompt(p, num_clusters=2, **MATRYOSHKA), 2, clusterns_reference),
    "clusterns_prefix": (lambda p: ClusterNSPrefix(p, num_clusters=2, prefix_len=2, **MATRYOSHKA), 2,
                         clusterns_reference),
}


@pytest.mark.parametrize("name", list(CASES))
def test_loss_is_the_weighted_sum_over_truncations(name: str, tiny_bert: str) -> None:
    build, views, reference = CASES[name]
    torch.manual_seed(0)
    method = build(tiny_bert).double()
    if hasattr(method, "cluster_state"):
        method.cluster_state.initialize_(torch.randn(2, 32, dtype=torch.float64))
    embeddings = torch.randn(views * N, 32, dtype=torch.float64)
    loss, logs = method.sentence_loss(embeddings, {"num_views": views})
    parts = [reference(embeddings, method, dim) for dim in DIMS]
    want = sum(w * part for w, part in zip(WEIGHTS, parts, strict=True))
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=0)
    for dim, part in zip(DIMS, parts, strict=True):
        torch.testing.assert_close(logs[f"matryoshka/loss_{dim}"], part, rtol=1e-12, atol=0)
    assert len({round(float(p), 6) for p in parts}) == len(DIMS)  # the truncations do change the loss


def test_without_dims_the_loss_is_the_methods_own(tiny_bert: str) -> None:
    method = SimCSE(tiny_bert).double()
    embeddings = torch.randn(2 * N, 32, dtype=torch.float64)
    loss, logs = method.sentence_loss(embeddings, {"num_views": 2})
    torch.testing.assert_close(loss, InfoNCELoss(0.05)(embeddings[:N], embeddings[N:], torch.arange(N)))
    assert not logs


def test_weights_default_to_one(tiny_bert: str) -> None:
    method = SimCSE(tiny_bert, matryoshka_dims=[32, 8]).double()
    embeddings = torch.randn(2 * N, 32, dtype=torch.float64)
    loss, _ = method.sentence_loss(embeddings, {"num_views": 2})
    reference = simcse_reference(InfoNCELoss(0.05), 2)
    torch.testing.assert_close(loss, reference(embeddings, method, 32) + reference(embeddings, method, 8))


@pytest.mark.parametrize(("options", "message"), [
    ({"matryoshka_dims": [64, 16]}, r"matryoshka_dims \[64, 16\]: \[64\] outside 1..32"),
    ({"matryoshka_dims": [16, 16]}, "repeated"),
    ({"matryoshka_dims": [32, 16], "matryoshka_weights": [1.0]}, "one weight per entry"),
    ({"matryoshka_weights": [1.0]}, "one weight per entry"),
    ({"matryoshka_eval_dim": 0}, r"matryoshka_eval_dim \[0\]: \[0\] outside 1..32"),
])
def test_settings_that_cannot_apply_are_one_line(options: dict, message: str, tiny_bert: str) -> None:
    with pytest.raises(SentEmbUserError, match=message):
        SimCSE(tiny_bert, **options)


def test_truncate_is_the_normalized_prefix() -> None:
    embeddings = torch.randn(5, 12, dtype=torch.bfloat16)
    got = truncate(embeddings, 4)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, F.normalize(embeddings[:, :4].float(), dim=-1))
    torch.testing.assert_close(got.norm(dim=-1), torch.ones(5))
