"""DCPCSE: a frozen backbone steered by deep prefixes, on tiny random BERT/RoBERTa (no network)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from transformers import BertConfig, BertModel

from lightning_sentemb.cli import main
from lightning_sentemb.data.datamodule import SentEmbDataModule
from lightning_sentemb.export import export
from lightning_sentemb.loading import load_method
from lightning_sentemb.losses.energy_hinge import InfoNCEHingeLoss, energy_hinge_loss
from lightning_sentemb.losses.info_nce import InfoNCELoss
from lightning_sentemb.losses.mlm import mlm_loss, token_prediction_loss
from lightning_sentemb.methods import DCPCSE, SimCSE
from lightning_sentemb.methods.building import build_method
from lightning_sentemb.methods.dcpcse import trainable_parameter_count
from tests.conftest import write_corpus

SENTENCES = ["a man plays guitar .", "the cat sleeps on the sofa all day long", "kids play football",
             " ".join(["a very long sentence"] * 80)]  # 320 words: longer than every tiny model allows


def examples(method: DCPCSE, rows: list[dict[str, str]]) -> list[dict[str, list[int]]]:
    """Tokenized training examples as the DataModule caches them."""
    tokenize = method.tokenizer
    return [{column: tokenize(text, add_special_tokens=False)["input_ids"] for column, text in row.items()}
            for row in rows]


def unsupervised_batch(method: DCPCSE) -> dict:
    return method.collate(examples(method, [{"sent0": s} for s in SENTENCES[:3]]))


def backbone_state(method: DCPCSE) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in method.encoder.backbone.state_dict().items()}


# ----- what trains -------------------------------------------------------------------------------
def test_bert_base_trainable_parameters_from_config(capsys) -> None:
    config = BertConfig()  # bert-base-uncased: 12 layers, hidden 768, vocab 30522
    with torch.device("meta"):
        backbone = sum(p.numel() for p in BertModel(config).parameters())  # AutoModel keeps the pooler
    assert backbone == 109_482_240
    prefix, mlp, mlm_head = 16 * 12 * 2 * 768, 768 * 768 + 768, 768 * 768 + 3 * 768 + 30522
    assert (prefix, mlp, mlm_head) == (294_912, 590_592, 622_650)
    cases = {
        "prefix 16 (paper: unsup. BERT-base)": (trainable_parameter_count(config, 16, mlp=False), prefix),
        "prefix 16 + training MLP": (trainable_parameter_count(config, 16), prefix + mlp),
        "prefix 16 + MLP + MLM head": (trainable_parameter_count(config, 16, mlm_head=True), prefix + mlp + mlm_head),
    }
    with capsys.disabled():
        for name, (count, by_hand) in cases.items():
            assert count == by_hand
            print(f"\nbert-base {name}: {count:,} trainable = {count / (backbone + count):.3%} of "
                  f"{backbone + count:,}; fp32 weights {4 * count / 2**20:.2f} MiB, "
                  f"with AdamW moments (Lightning checkpoint) {12 * count / 2**20:.2f} MiB")
    assert prefix / backbone == pytest.approx(0.002694, abs=1e-6)  # the paper's "around 0.1%" is for large models


@pytest.mark.parametrize("family", ["tiny_bert", "tiny_roberta"])
@pytest.mark.parametrize("mlp,mlm,projection", [("train", False, False), ("none", True, False), ("always", True, True)])
def test_parameter_count_formula_matches_the_module(family, mlp, mlm, projection, request) -> None:
    method = build_method(DCPCSE, request.getfixturevalue(family), prefix_len=5, mlp=mlp,
                          mlm_weight=0.1 if mlm else 0.0,
                    prefix_projection=projection, prefix_hidden_size=24)
    trainable = sum(p.numel() for p in method.parameters() if p.requires_grad)
    config = method.encoder.backbone.config
    assert trainable == trainable_parameter_count(config, 5, projection, 24, mlp=mlp != "none", mlm_head=mlm)


@pytest.mark.parametrize("family", ["tiny_bert", "tiny_roberta"])
def test_backbone_frozen_in_train_mode_and_mlm_decoder_tied(family, request) -> None:
    method = build_method(DCPCSE, request.getfixturevalue(family), prefix_len=4, mlm_weight=0.1)
    encoder = method.encoder
    assert method.training and encoder.backbone.training, "dropout is the augmentation"
    assert not any(p.requires_grad for p in encoder.backbone.parameters())
    decoder = encoder.mlm_model.get_output_embeddings()
    assert decoder.weight is encoder.backbone.get_input_embeddings().weight and not decoder.weight.requires_grad
    trainable = {name for name, p in method.named_parameters() if p.requires_grad}
    base_model = f"encoder.mlm_model.{encoder.mlm_model.base_model_prefix}."
    head = {name for name, _ in method.named_parameters() if name.startswith("encoder.mlm_model.")
            and not name.startswith(base_model)}  # the tied decoder weight is listed under the embeddings
    prefix = {f"encoder.prefixed.prefix_encoder.{name}"
              for name, _ in encoder.prefixed.prefix_encoder.named_parameters()}
    assert head and trainable == prefix | head | {"mlp.0.weight", "mlp.0.bias"}


# ----- equivalence with the plain backbone --------------------------------------------------------
@pytest.mark.parametrize("family", ["tiny_bert", "tiny_roberta"])
@pytest.mark.parametrize("pooler", ["cls", "avg", "avg_first_last", "avg_top2"])
def test_zero_length_prefix_reproduces_the_plain_backbone(family, pooler, request) -> None:
    path = request.getfixturevalue(family)
    prefixed = build_method(DCPCSE, path, prefix_len=0, pooler=pooler, mlp="none", mlm_weight=0.1)
    plain = build_method(SimCSE, path, pooler=pooler, mlp="none", mlm_weight=0.1)
    assert torch.equal(prefixed.encode(SENTENCES), plain.encode(SENTENCES))
    features = unsupervised_batch(plain)["features"]
    batch = {key: features[key] for key in ("input_ids", "attention_mask")}
    prefixed.encoder.mlm_model.load_state_dict(plain.encoder.mlm_model.state_dict())  # both heads are fresh
    prefixed.eval(), plain.eval()
    with torch.no_grad():
        every_position = torch.arange(batch["input_ids"].numel())
        torch.testing.assert_close(prefixed.encoder.mlm_logits(**batch, layout=None, index=every_position),
                                   plain.encoder.mlm_logits(**batch, layout=None, index=every_position), rtol=0, atol=0)


def test_truncation_is_capped_by_the_shifted_positions(tiny_bert) -> None:
    assert build_method(SimCSE, tiny_bert, mlp="none").encoder.max_length == 128
    assert build_method(DCPCSE, tiny_bert, prefix_len=3).encoder.max_length == 125
    assert build_method(DCPCSE, tiny_bert, prefix_len=3, position_offset="zero").encoder.max_length == 128
    method = build_method(DCPCSE, tiny_bert, prefix_len=3)
    assert method.sentence_features(SENTENCES[-1:])["input_ids"].shape == (1, 125)
    assert method.encode(SENTENCES).shape == (4, 32)


# ----- gradients and the loss ---------------------------------------------------------------------
@pytest.mark.parametrize("family", ["tiny_bert", "tiny_roberta"])
def test_gradients_reach_the_prefix_of_every_layer_from_both_losses(family, request) -> None:
    method = build_method(DCPCSE, request.getfixturevalue(family), prefix_len=4, mlm_weight=0.1)
    batch = unsupervised_batch(method)
    weight = method.encoder.prefixed.prefix_encoder.embedding.weight
    layers, hidden = method.encoder.backbone.config.num_hidden_layers, method.encoder.hidden_size

    def assert_every_layer_key_and_value_has_gradient() -> None:
        per_layer = weight.grad.view(4, layers, 2, hidden).abs().sum(dim=(0, 3))  # (layer, key/value)
        assert bool((per_layer > 0).all()), per_layer
        assert all(p.grad is None for p in method.encoder.backbone.parameters())

    contrastive, _ = method.training_loss(batch)
    contrastive.backward()
    assert_every_layer_key_and_value_has_gradient()
    weight.grad = None
    mlm = batch["mlm"]  # the MLM forward alone: it goes through the prefix too
    token_prediction_loss(method.encoder, mlm, mlm["predicted"]).backward()
    assert_every_layer_key_and_value_has_gradient()


@pytest.mark.parametrize("padding_free", [True, False])
@pytest.mark.parametrize("method_class", [SimCSE, DCPCSE])
def test_mlm_head_on_the_predicted_rows_equals_every_position(method_class, padding_free, tiny_bert) -> None:
    """The auxiliary MLM loss of `step_loss` runs the head on the masked tokens' states alone; its value and
    gradients equal the full-vocabulary logits at every position scored as before (float64, 1e-6)."""
    options = {} if method_class is SimCSE else {"prefix_len": 2}
    method = build_method(method_class, tiny_bert, mlm_weight=0.1, mlp="none", dropout=0.0,
                          attn_implementation=None if padding_free else "padded", **options).double()
    assert method.encoder.padding_free == padding_free
    batch = unsupervised_batch(method)
    mlm, predicted = batch["mlm"], batch["mlm"]["predicted"]
    head_rows = []
    method.encoder.mlm_model.get_output_embeddings().register_forward_hook(
        lambda module, args, out: head_rows.append(args[0].shape[0]))
    mlm_only = method.step_loss(batch)[1]["mlm_loss"]
    assert head_rows == [predicted.count] and 0 < predicted.count < mlm["attention_mask"].sum() / 3
    trainable = [p for p in method.parameters() if p.requires_grad]
    got = torch.autograd.grad(mlm_only, trainable, allow_unused=True)
    labels = torch.full((mlm["input_ids"].numel(),), -100)
    labels[predicted.index] = predicted.labels
    every_position = torch.arange(mlm["input_ids"].numel())
    logits = method.encoder.mlm_logits(mlm["input_ids"], mlm["attention_mask"], mlm["layout"], every_position)
    expected = mlm_loss(logits, labels)
    want = torch.autograd.grad(expected, trainable, allow_unused=True)
    torch.testing.assert_close(mlm_only, expected, rtol=1e-6, atol=1e-6)
    assert sum(g is not None for g in got) > 2
    for a, b in zip(got, want, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_gradients_reach_the_reparameterized_prefix(tiny_bert) -> None:
    method = build_method(DCPCSE, tiny_bert, prefix_len=4, prefix_projection=True, prefix_hidden_size=16)
    loss, _ = method.training_loss(unsupervised_batch(method))
    loss.backward()
    for name, p in method.encoder.prefixed.prefix_encoder.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_mlm_weight_schedule_by_hand(tiny_bert, monkeypatch) -> None:
    method = build_method(DCPCSE, tiny_bert, prefix_len=2, mlm_weight=0.1)  # decay 0.95 every 100 steps (paper)
    expected = {0: 0.1, 50: 0.1 * math.sqrt(0.95), 100: 0.095, 200: 0.09025, 1000: 0.05987369392383789}
    for step, weight in expected.items():
        assert method.mlm_weight_at(step) == pytest.approx(weight, rel=1e-12), step
    decaying = build_method(DCPCSE, tiny_bert, mlm_weight=0.2, mlm_decay_rate=0.5, mlm_decay_steps=10)
    assert decaying.mlm_weight_at(20) == pytest.approx(0.05)
    assert build_method(DCPCSE, tiny_bert).mlm_weight_at(500) == 0.0  # MLM off by default (paper: BERT)

    # training_step weighs the MLM loss with the weight at the current global step
    monkeypatch.setattr(DCPCSE, "global_step", property(lambda self: 200))
    method.eval()  # deterministic: no dropout
    batch = unsupervised_batch(method)
    with torch.no_grad():
        total = method.training_step(batch, 0)
        contrastive, _ = method.training_loss(batch)
        mlm = batch["mlm"]
        auxiliary = token_prediction_loss(method.encoder, mlm, mlm["predicted"])
    torch.testing.assert_close(total, contrastive + 0.09025 * auxiliary)


def test_energy_hinge_by_hand() -> None:
    anchors = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    positives = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    hard_negatives = torch.tensor([[0.0, 1.0], [-1.0, 0.0]])
    labels = torch.tensor([0, 1])
    # anchor 0: positive 1, hardest negative 1/√2 -> 0.2 - 0.29 < 0 -> 0
    # anchor 1: positive 1/√2, hardest negative (hard negative 0) 1 -> 0.2 - (1/√2 - 1) = 1.2 - 1/√2
    by_hand = (1.2 - 2**-0.5) / 2
    assert energy_hinge_loss(anchors, positives, labels, hard_negatives, 0.2).item() == pytest.approx(by_hand)
    assert energy_hinge_loss(anchors, positives, labels, None, 0.2).item() == 0.0
    total = InfoNCEHingeLoss(0.05, 0.0, 0.2, 10.0)(anchors, positives, labels, hard_negatives)
    info_nce = InfoNCELoss(0.05)(anchors, positives, labels, hard_negatives)
    assert total.item() == pytest.approx(info_nce.item() + 10 * by_hand)


def reference_hinge(z1: torch.Tensor, z2: torch.Tensor, z3: torch.Tensor, margin: float, temp: float) -> torch.Tensor:
    """The reference's formulation: logits (cos/τ), diagonal of the in-batch block set to -1e9,
    max over [in-batch | hard negatives], MarginRankingLoss on the logits times τ."""
    cos = torch.nn.CosineSimilarity(dim=-1)
    z1_z2 = cos(z1.unsqueeze(1), z2.unsqueeze(0)) / temp
    z1_z3 = cos(z1.unsqueeze(1), z3.unsqueeze(0)) / temp
    anchor_pos = torch.diag(z1_z2).unsqueeze(-1)
    mask = torch.eye(z1_z2.size(0))
    masked = mask * -1e9 + (1 - mask) * z1_z2
    hardest = torch.cat([masked, z1_z3], dim=-1).max(dim=-1, keepdim=True).values
    return torch.nn.MarginRankingLoss(margin=margin)(anchor_pos * temp, hardest * temp, torch.ones_like(anchor_pos))


def test_energy_hinge_matches_the_reference_formulation() -> None:
    generator = torch.Generator().manual_seed(0)
    z1, z2, z3 = (torch.randn(16, 8, generator=generator) for _ in range(3))
    z2 = z1 + 0.7 * z2  # positives close enough that some anchors pass the margin and some do not
    ours = energy_hinge_loss(z1, z2, torch.arange(16), z3, margin=0.2)
    assert 0 < ours.item()
    torch.testing.assert_close(ours, reference_hinge(z1, z2, z3, 0.2, 0.05), rtol=1e-5, atol=1e-6)


# ----- training, checkpoints, export --------------------------------------------------------------
class BackboneModeProbe(Callback):
    """Records the backbone's train/eval mode at every training batch."""

    def __init__(self) -> None:
        self.modes: list[bool] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.modes.append(pl_module.encoder.backbone.training)


def short_fit(method: DCPCSE, corpus: Path, root: Path, max_steps: int = 3, ckpt_path: str | None = None) -> Trainer:
    data = SentEmbDataModule(train_file=str(corpus), batch_size=8, cache_dir=str(root / "cache"), val_tasks=[],
                             test_tasks=[])
    trainer = Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                      callbacks=[BackboneModeProbe()], default_root_dir=str(root))
    trainer.fit(method, datamodule=data, ckpt_path=ckpt_path)
    return trainer


@pytest.fixture(scope="module")
def fitted(tiny_bert, tmp_path_factory):
    """A 3-step fit with the MLM loss on, shared by the tests that read it (none changes it); returns
    (method, backbone before, trainable tensors before, trainer, checkpoint path)."""
    root = tmp_path_factory.mktemp("dcpcse_fit")
    torch.manual_seed(0)
    method = build_method(DCPCSE, tiny_bert, prefix_len=4, mlm_weight=0.1, lr=1e-2)
    before = backbone_state(method)
    trainable_before = {n: p.detach().clone() for n, p in method.named_parameters() if p.requires_grad}
    trainer = short_fit(method, write_corpus(root), root)
    checkpoint = root / "last.ckpt"
    trainer.save_checkpoint(checkpoint)
    return method, before, trainable_before, trainer, checkpoint


def test_short_fit_changes_only_trainable_tensors(fitted) -> None:
    method, before, trainable_before, trainer, _ = fitted
    assert trainer.global_step == 3
    (probe,) = [c for c in trainer.callbacks if isinstance(c, BackboneModeProbe)]
    assert probe.modes == [True, True, True]
    after = method.encoder.backbone.state_dict()
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), f"backbone tensor {name} changed"
    for name, p in method.named_parameters():
        if p.requires_grad:
            assert not torch.equal(p.detach(), trainable_before[name]), f"trainable {name} did not move"


def test_checkpoint_holds_only_trainable_tensors_and_reloads(fitted, corpus_file, tmp_path) -> None:
    method, _, _, _, path = fitted
    checkpoint = torch.load(path, weights_only=False)
    trainable = {name for name, p in method.named_parameters(remove_duplicate=False) if p.requires_grad}
    assert set(checkpoint["state_dict"]) == trainable  # tied tensors (the MLM output bias) under both names
    assert checkpoint["hyper_parameters"]["backbone"] == method.hparams.backbone
    assert checkpoint["sentemb_method"] == "lightning_sentemb.methods.dcpcse.DCPCSE"
    moments = [t for state in checkpoint["optimizer_states"][0]["state"].values() for t in state.values() if t.dim()]
    assert sum(t.numel() for t in moments) == 2 * sum(p.numel() for p in method.parameters() if p.requires_grad)
    saved = sum(t.numel() for t in checkpoint["state_dict"].values())
    assert saved < sum(p.numel() for p in method.parameters()) / 10

    expected = method.encode(SENTENCES)
    for reloaded in (DCPCSE.load_from_checkpoint(path), load_method(str(path))):
        assert torch.equal(reloaded.encode(SENTENCES), expected)

    del checkpoint["state_dict"]["encoder.prefixed.prefix_encoder.embedding.weight"]
    torch.save(checkpoint, tmp_path / "broken.ckpt")
    with pytest.raises(RuntimeError, match="Missing key.*prefix_encoder"):
        DCPCSE.load_from_checkpoint(tmp_path / "broken.ckpt")

    resumed = build_method(DCPCSE, method.hparams.backbone, prefix_len=4, mlm_weight=0.1, lr=1e-2)
    trainer = short_fit(resumed, corpus_file, tmp_path / "resume", max_steps=4, ckpt_path=str(path))
    assert trainer.global_step == 4


def test_sentemb_export_of_a_checkpoint_round_trips(fitted, tmp_path) -> None:
    from sentence_transformers import SentenceTransformer

    _, _, _, _, path = fitted
    main(["export", str(path), str(tmp_path / "export")])
    method = load_method(str(path))
    st = SentenceTransformer(str(tmp_path / "export"), device="cpu", trust_remote_code=True)
    torch.testing.assert_close(torch.as_tensor(st.encode(SENTENCES)), method.encode(SENTENCES), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "family,pooler,mlp,projection",
    [("tiny_bert", "cls", "train", False), ("tiny_bert", "cls", "always", True),
     ("tiny_roberta", "avg", "none", False), ("tiny_roberta", "avg_first_last", "none", False),
     ("tiny_bert", "avg_top2", "none", False)],
)
def test_export_holds_prefix_and_backbone_reference_and_reproduces_embeddings(family, pooler, mlp, projection, request,
                                                                              tmp_path) -> None:
    from sentence_transformers import SentenceTransformer

    torch.manual_seed(0)
    method = build_method(DCPCSE, request.getfixturevalue(family), prefix_len=4, pooler=pooler, mlp=mlp,
                    prefix_projection=projection, prefix_hidden_size=16)
    for p in method.encoder.prefixed.prefix_encoder.parameters():
        torch.nn.init.normal_(p, std=0.5)  # a prefix that visibly changes the embeddings
    plain = build_method(SimCSE, method.hparams.backbone, pooler=pooler, mlp=mlp)
    assert not torch.allclose(method.encode(SENTENCES), plain.encode(SENTENCES))
    folder = export(method, tmp_path / "export")

    weights = [f for f in folder.rglob("*.safetensors")]
    backbone_size = sum(p.numel() for p in method.encoder.backbone.parameters()) * 4
    assert sum(f.stat().st_size for f in weights) < backbone_size / 4, "the export must not copy the backbone"
    assert not (folder / "config.json").exists()
    st = SentenceTransformer(str(folder), device="cpu", trust_remote_code=True)
    torch.testing.assert_close(torch.as_tensor(st.encode(SENTENCES)), method.encode(SENTENCES), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="trust_remote_code"):
        SentenceTransformer(str(folder), device="cpu")


# ----- supervised and the CLI ---------------------------------------------------------------------
def test_supervised_fit_with_nli_triplets_and_energy_hinge(tiny_bert, sts_fixture, tmp_path) -> None:
    nli = tmp_path / "nli.csv"
    nli.write_text("sent0,sent1,hard_neg\n"
                   + "".join(f"a man {i} runs,a person {i} moves,nobody {i} sits\n" for i in range(32)))
    main(["fit", "--model", "lightning_sentemb.methods.DCPCSE", "--model.backbone", tiny_bert,
          "--model.prefix_len", "3", "--model.mlp", "always", "--model.hinge_weight", "10",
          "--data.train_file", str(nli), "--data.data_dir", str(sts_fixture), "--data.batch_size", "8",
          "--data.cache_dir", str(tmp_path / "cache"), "--trainer.default_root_dir", str(tmp_path),
          "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.check_val_every_n_epoch", "null",
          "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu", "--trainer.log_every_n_steps", "1"])
    method = load_method(str(tmp_path / "checkpoints" / "best.ckpt"))
    assert isinstance(method, DCPCSE) and isinstance(method.loss_fn, InfoNCEHingeLoss)
    assert method.loss_fn.get_config_dict()["hinge_weight"] == 10.0
    metrics = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert "val/STSBenchmark-dev" in metrics


@pytest.mark.slow
def test_demo_config_fits(shared_data, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SENTEMB_DATA", str(shared_data))
    main(["fit", "-c", "experiments/demo/dcpcse.yaml", "--trainer.max_steps", "3", "--trainer.val_check_interval", "3",
          "--trainer.limit_val_batches", "1", "--trainer.default_root_dir", str(tmp_path),
          "--data.cache_dir", str(tmp_path / "cache"), "--data.max_train_examples", "512",
          "--data.batch_size", "16", "--data.eval_batch_size", "64",
          "--trainer.precision", "32-true"])
    checkpoint = torch.load(tmp_path / "checkpoints" / "best.ckpt", weights_only=False)
    assert all("prefix_encoder" in name or name.startswith("mlp.") for name in checkpoint["state_dict"])
