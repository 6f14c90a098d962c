"""Supervised ConSERT (`methods.consert_joint`): the joint loss and every gradient against the reference's
`AdvCLSoftmaxLoss` equations written out in float64, the views against ConSERT's draws for the same
sentences, the one-line refusals, and the configs. Gradient caching, padding-free, LoRA, the families and
the step's host syncs: the shared tables (test_grad_cache, test_backbones, test_lora, test_sync_free)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.export import export
from lightning_sentemb.lightning_cli import lightning_main
from lightning_sentemb.loading import load_method
from lightning_sentemb.methods import ConSERT, ConSERTJoint
from lightning_sentemb.methods.building import build_method
from tests.examples import training_examples
from tests.test_backbones import SENTENCES, quiet
from tests.test_consert import reference_loss
from tests.test_padding_free import assert_packed_equals_padded, without_dropout

REPO = Path(__file__).resolve().parents[1]

TAU = 0.1


def reference_joint_loss(rows: torch.Tensor, labels: torch.Tensor, classifier: torch.nn.Linear, view: int,
                         max_square: bool) -> torch.Tensor:
    """`AdvCLSoftmaxLoss.forward` with `--add_cl --cl_rate 0.15 --temperature 0.1`: CE over the classifier's
    (u, v, |u − v|[, max(u, v)²]) of the classified view, plus 0.15 × the reference's contrastive loss of the
    premises (rep_a, rep_a_cutoff) and of the hypotheses (rep_b, rep_b_cutoff), each its own batch."""
    n = labels.numel()
    premises = [rows[v * 2 * n : v * 2 * n + n] for v in (0, 1)]
    hypotheses = [rows[v * 2 * n + n : (v + 1) * 2 * n] for v in (0, 1)]
    u, v = premises[view], hypotheses[view]
    features = [u, v, (u - v).abs()] + ([torch.max(u, v).pow(2)] if max_square else [])
    ce = F.cross_entropy(classifier(torch.cat(features, dim=1)), labels)
    return ce + reference_loss(*premises, TAU) + reference_loss(*hypotheses, TAU)


@pytest.mark.parametrize(("view", "max_square"), [(0, True), (1, False)])
def test_joint_loss_and_gradients_equal_the_reference_equations(tiny_bert, view, max_square):
    method = build_method(ConSERTJoint, tiny_bert, classifier_view=view,
                          concatenation_sent_max_square=max_square).double()
    generator = torch.Generator().manual_seed(0)
    n = 5
    rows = torch.randn(4 * n, method.output_size, generator=generator, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 2, 1, 1, 0])
    ours, logs = method.embedding_loss(rows, {"labels": labels})
    parameters = [rows, *method.loss_fn.classifier.parameters()]
    our_grads = torch.autograd.grad(ours, parameters)
    expected = reference_joint_loss(rows, labels, method.loss_fn.classifier, view, max_square)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)
    for got, want in zip(our_grads, torch.autograd.grad(expected, parameters), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert set(logs) == {"accuracy", "classification_loss", "contrastive_loss"}


def test_views_are_consert_draws_of_the_premises_then_the_hypotheses(tiny_bert):
    """Same sentences, same seed: ConSERT's collator of [premises, hypotheses] draws the same rows and edits."""
    options = dict(augmentations=["feature_cutoff", "token_cutoff"], token_cutoff_rate=0.3, feature_cutoff_rate=0.25)
    joint, plain = build_method(ConSERTJoint, tiny_bert, **options), build_method(ConSERT, tiny_bert, **options)
    examples = training_examples(joint, SENTENCES[:4])
    joint.collate_generator.manual_seed(7)
    batch = joint.collate(examples)
    sentences = [e["premise"] for e in examples] + [e["hypothesis"] for e in examples]
    plain.collate_generator.manual_seed(7)
    expected = plain.collate([{"sent0": ids} for ids in sentences])
    assert batch["labels"].tolist() == [0, 1, 2, 0] and batch["num_views"] == 2
    assert batch["features"].keys() == expected["features"].keys() >= {"token_keep", "feature_keep"}
    for key, value in expected["features"].items():
        assert not isinstance(value, torch.Tensor) or torch.equal(batch["features"][key], value), key
    assert not batch["features"]["token_keep"][8:].all() and batch["features"]["token_keep"][:8].all()
    # the default pair: the sentence as it is, then its token cutoff
    features = build_method(ConSERTJoint, tiny_bert).collate(examples)["features"]
    assert "feature_keep" not in features and features["token_keep"][:8].all() and not features["token_keep"][8:].all()


@pytest.mark.parametrize(("options", "message"), [
    (dict(augmentations=["none", "adversarial"]), "model.init_args.augmentations: adversarial is not built"),
    (dict(classifier_view=2), "model.init_args.classifier_view must be 0 or 1"),
    (dict(guide="self"), "model.init_args.guide: not for ConSERTJoint"),
    (dict(matryoshka_dims=[16, 8]), "model.init_args.matryoshka_dims: not for ConSERTJoint"),
    (dict(augmentations=["shuffle"]), "model.init_args.augmentations: give two"),
])
def test_what_the_joint_stage_refuses(options, message, tiny_bert):
    with pytest.raises(SentEmbUserError, match=re.escape(message)) as refusal:
        build_method(ConSERTJoint, tiny_bert, **options)
    assert "\n" not in str(refusal.value)
    with pytest.raises(SentEmbUserError, match="the corpus has no column premise, hypothesis, label"):
        build_method(ConSERTJoint, tiny_bert).collator.check_columns(["sent0"], "wiki.txt")


def test_packed_forward_equals_padded_for_the_same_draws(tiny_roberta):
    """RoBERTa's shifted positions shuffled in one view, token cutoff in the other, the classifier's rows."""
    torch.manual_seed(0)
    method = quiet(without_dropout(build_method(ConSERTJoint, tiny_roberta, augmentations=["shuffle", "token_cutoff"])))
    assert method.encoder.padding_free
    method.collate_generator.manual_seed(0)
    assert_packed_equals_padded(method.train(), method.collate(training_examples(method, SENTENCES)))


def test_both_stages_fit_from_their_configs_the_second_from_the_firsts_export(tiny_bert, sts_fixture, tmp_path):
    """experiments/consert_sup.yaml for 2 steps on labelled pairs, its best checkpoint exported, then
    experiments/consert_sup_unsup.yaml from that folder: ConSERT starts from the joint stage's backbone."""
    pairs, sentences = tmp_path / "pairs.csv", [s.replace(",", "") for s in SENTENCES]
    pairs.write_text("premise,hypothesis,label\n" + "".join(
        f"{a},{b},{['entailment', 'neutral', 'contradiction'][i % 3]}\n"
        for i, (a, b) in enumerate(zip(sentences, sentences[1:] + sentences[:1], strict=True))))

    def fit(config: str, backbone: str, train_file: str, root: Path) -> None:
        lightning_main(["fit", "-c", str(REPO / "experiments" / f"{config}.yaml"), "--model.backbone", backbone,
                        "--data.train_file", train_file, "--data.data_dir", str(sts_fixture), "--data.batch_size", "4",
                        "--data.cache_dir", str(tmp_path / "cache"), "--data.val_tasks", "[STSBenchmark-dev]",
                        "--trainer.default_root_dir", str(root), "--trainer.max_steps", "2",
                        "--trainer.val_check_interval", "2", "--trainer.precision", "32-true",
                        "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
                        "--trainer.enable_model_summary", "false", "--trainer.logger", "false"])

    fit("consert_sup", tiny_bert, str(pairs), tmp_path / "joint")
    joint = load_method(str(tmp_path / "joint" / "checkpoints" / "best.ckpt"))
    assert isinstance(joint, ConSERTJoint) and joint.hparams.concatenation_sent_max_square
    folder = export(joint.eval(), tmp_path / "export")
    unsup = build_method(ConSERT, str(folder))
    trained, started = joint.encoder.backbone.state_dict(), unsup.encoder.backbone.state_dict()
    assert trained.keys() == started.keys() and all(torch.equal(trained[k], started[k]) for k in trained)
    original = build_method(ConSERT, tiny_bert).encoder.backbone.state_dict()
    assert not all(torch.equal(trained[k], original[k]) for k in trained)  # the joint stage trained it
    fit("consert_sup_unsup", str(folder), "senteval:sts", tmp_path / "unsup")
    assert isinstance(load_method(str(tmp_path / "unsup" / "checkpoints" / "best.ckpt")), ConSERT)
