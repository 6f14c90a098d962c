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
from lightning_sentemb.losses.info_nce import InfoNCELoss, info_nce
from lightning_sentemb.losses.mixcse import MixCSELoss
from lightning_sentemb.matryoshka import truncate
from lightning_sentemb.methods import DCPCSE, ClusterNS, ClusterNSPrefix, ClusterNSPrompt, ConPVP, PromptBERT, SimCSE
from lightning_sentemb.methods.building import build_method
from lightning_sentemb.methods.consert import ConSERT
from lightning_sentemb.methods.esimcse import ESimCSE
from lightning_sentemb.methods.mixcse import MixCSE
from tests.test_consert import paper_nt_xent

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


def esimcse_with_queue(path: str) -> ESimCSE:
    """A queue of 5 holding 3 keys; in evaluation mode, so the loss takes no momentum step of its own."""
    method = build_method(ESimCSE, path, queue_size=5, **MATRYOSHKA).eval()
    method.queue.allocate(5, "queue_size")
    method.queue.push(torch.randn(3, 32, generator=torch.Generator().manual_seed(1)))
    return method


def esimcse_reference(embeddings, method, dim):
    """The queue's keys truncated like the rows, extra columns of every anchor's softmax."""
    rows = cut(embeddings, dim).unflatten(0, (2, -1))
    return info_nce(rows[0], torch.cat([rows[1], cut(method.queue.embeddings[-3:], dim)]), torch.arange(N))


def mixcse_reference(embeddings, method, dim):
    """The mixes made of the truncated positives, the partners drawn once for every truncation."""
    rows = cut(embeddings, dim).unflatten(0, (2, -1))
    return MixCSELoss().paper(rows[0], rows[1], torch.arange(N), method.partners(N, torch.device("cpu")))


CASES = {
    "simcse": (lambda p: build_method(SimCSE, p, **MATRYOSHKA), 2, simcse_reference(InfoNCELoss(0.05), 2)),
    "simcse_sup": (lambda p: build_method(SimCSE, p, hard_negative_weight=0.5, **MATRYOSHKA), 3,
                   simcse_reference(InfoNCELoss(0.05, 0.5), 3)),
    "promptbert": (lambda p: build_method(PromptBERT, p, **MATRYOSHKA), 2, simcse_reference(InfoNCELoss(0.05), 2)),
    "conpvp": (lambda p: build_method(ConPVP, p, **MATRYOSHKA), 3, simcse_reference(InfoNCELoss(0.05), 3)),
    "dcpcse_sup_hinge": (lambda p: build_method(DCPCSE, p, prefix_len=2, hinge_weight=10.0, **MATRYOSHKA), 3,
                         simcse_reference(InfoNCEHingeLoss(0.05, 0.0, 0.2, 10.0), 3)),
    "clusterns": (lambda p: build_method(ClusterNS, p, num_clusters=2, **MATRYOSHKA), 2, clusterns_reference),
    "clusterns_prompt": (lambda p: build_method(ClusterNSPrompt, p, num_clusters=2, **MATRYOSHKA), 2,
                         clusterns_reference),
    "clusterns_prefix": (lambda p: build_method(ClusterNSPrefix, p, num_clusters=2, prefix_len=2, **MATRYOSHKA), 2,
                         clusterns_reference),
    "consert": (lambda p: build_method(ConSERT, p, **MATRYOSHKA), 2,
                lambda embeddings, method, dim: paper_nt_xent(*cut(embeddings, dim).unflatten(0, (2, -1)), 0.1)),
    "esimcse": (esimcse_with_queue, 2, esimcse_reference),
    "mixcse": (lambda p: build_method(MixCSE, p, num_mixed=2, **MATRYOSHKA), 2, mixcse_reference),
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
    method = build_method(SimCSE, tiny_bert).double()
    embeddings = torch.randn(2 * N, 32, dtype=torch.float64)
    loss, logs = method.sentence_loss(embeddings, {"num_views": 2})
    torch.testing.assert_close(loss, InfoNCELoss(0.05)(embeddings[:N], embeddings[N:], torch.arange(N)))
    assert not logs


def test_weights_default_to_one(tiny_bert: str) -> None:
    method = build_method(SimCSE, tiny_bert, matryoshka_dims=[32, 8]).double()
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
        build_method(SimCSE, tiny_bert, **options)


def test_truncate_is_the_normalized_prefix() -> None:
    embeddings = torch.randn(5, 12, dtype=torch.bfloat16)
    got = truncate(embeddings, 4)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, F.normalize(embeddings[:, :4].float(), dim=-1))
    torch.testing.assert_close(got.norm(dim=-1), torch.ones(5))


# ----- a short Matryoshka fit: validation at a truncation, evaluate --dims, export ---------------------
SENTENCES = ["a man plays guitar .", "the cat sleeps on the sofa all day long", "kids play football"]


@pytest.fixture(scope="module")
def matryoshka_run(tiny_bert, sts_fixture, tmp_path_factory):
    from lightning_sentemb.cli import main

    from .test_end_to_end import fit_args

    root = tmp_path_factory.mktemp("matryoshka_run")
    main(["fit", *fit_args(tiny_bert, sts_fixture, root, "--model.pooler", "avg", "--model.mlp", "none",
                           "--model.matryoshka_dims", "[32, 16, 8]", "--model.matryoshka_weights", "[1, 1, 0.5]",
                           "--model.matryoshka_eval_dim", "16")])
    return root


def hand_sts(method, tasks, dim: int | None) -> dict[str, float]:
    """encode, then the first `dim` columns over their norm, then the STS scoring."""
    from lightning_sentemb.evaluation.sts import evaluate_sts

    def encode(sentences):
        embeddings = method.encode(list(sentences))
        return embeddings if dim is None else cut(embeddings, dim)

    return evaluate_sts(encode, tasks)


def test_validation_selects_on_the_truncation(matryoshka_run, sts_fixture):
    from lightning_sentemb.data.senteval import load_sts_task
    from lightning_sentemb.loading import load_method

    best = matryoshka_run / "checkpoints" / "best.ckpt"
    checkpoint = torch.load(best, weights_only=False)
    state = next(v for k, v in checkpoint["callbacks"].items() if "SentEmbCheckpoint" in k)
    method = load_method(str(best))
    dev = [load_sts_task("STSBenchmark-dev", sts_fixture)]
    at_16 = hand_sts(method, dev, 16)["STSBenchmark-dev"]
    assert float(state["best_model_score"]) == pytest.approx(at_16, abs=1e-4)
    assert at_16 != pytest.approx(hand_sts(method, dev, None)["STSBenchmark-dev"], abs=1e-3)
    metrics = (matryoshka_run / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert all(f"train/matryoshka/loss_{d}" in metrics for d in (32, 16, 8))


def test_evaluate_dims_scores_each_truncation_as_encode_truncate_normalize(matryoshka_run, sts_fixture, tmp_path):
    import json

    from lightning_sentemb.cli import main
    from lightning_sentemb.data.senteval import STS_TASKS, load_sts_task
    from lightning_sentemb.loading import load_method

    best = matryoshka_run / "checkpoints" / "best.ckpt"
    main(["evaluate", "--model", str(best), "--name", "run", "--tasks", "sts", "--dims", "8,16",
          "--data-dir", str(sts_fixture), "--output", str(tmp_path / "report")])
    results = json.loads((tmp_path / "report" / "results.json").read_text())
    assert list(results) == ["run", "run @8", "run @16"]
    assert results["run @8"]["dim"] == 8 and "dim" not in results["run"]
    method = load_method(str(best))
    tasks = [load_sts_task(t, sts_fixture) for t in STS_TASKS]
    for label, dim in (("run", None), ("run @8", 8), ("run @16", 16)):
        assert results[label]["sts"] == pytest.approx(hand_sts(method, tasks, dim), abs=1e-6), label
    assert "| run @8 |" in (tmp_path / "report" / "report.md").read_text()

    # the export records the sizes, serves a truncation, and its card lists the score at each size
    from sentence_transformers import SentenceTransformer

    main(["export", str(best), str(tmp_path / "export"), "--results", str(tmp_path / "report")])
    config = json.loads((tmp_path / "export" / "config_sentence_transformers.json").read_text())
    assert config["matryoshka_dims"] == [32, 16, 8]
    st = SentenceTransformer(str(tmp_path / "export"), device="cpu", truncate_dim=8)
    torch.testing.assert_close(torch.as_tensor(st.encode(SENTENCES)), method.encode(SENTENCES)[:, :8],
                               atol=1e-5, rtol=0)
    card = (tmp_path / "export" / "README.md").read_text()
    assert "trained at sizes [32, 16, 8]" in card
    for label, dim in (("run", "all"), ("run @8", 8), ("run @16", 16)):
        sts = results[label]["sts"]
        assert f"| {dim} | " + " | ".join(f"{sts[t]:.2f}" for t in sts) + " |" in card


def test_dims_beyond_the_embedding_are_one_line(matryoshka_run, sts_fixture, capsys):
    from lightning_sentemb.cli import main

    with pytest.raises(SystemExit):
        main(["evaluate", "--model", str(matryoshka_run / "checkpoints" / "best.ckpt"), "--dims", "8,64",
              "--data-dir", str(sts_fixture)])
    assert "--dims [8, 64]: [64] outside 1..32" in capsys.readouterr().err


def test_lora_adapters_train_on_the_matryoshka_loss(tiny_bert: str) -> None:
    """The truncations' loss reaches the adapters (the backbone frozen) like the plain one."""
    torch.manual_seed(0)
    method = build_method(SimCSE, tiny_bert, lora={"r": 2, "alpha": 4, "dropout": 0.0}, matryoshka_dims=[32, 8],
                          mlp="none")
    ids = method.encoder.format.sentence_ids(SENTENCES + ["the sun shines"])
    loss, logs = method.step_loss(method.collate([{"sent0": row} for row in ids]))
    loss.backward()
    adapters = {n: p.grad for n, p in method.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    # B starts at zero (peft), so A's first gradient is zero; every B gets one
    assert all(g.abs().sum() > 0 for n, g in adapters.items() if "lora_B" in n)
    assert set(logs) == {"matryoshka/loss_32", "matryoshka/loss_8"}
