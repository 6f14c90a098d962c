"""ClusterNS as a method: fits through the CLI, the logged curves, exact resume of the centroids,
checkpoint contents from step 0, the ablation switches, global initialization, the prompt variant,
and the demo config (its centroids under 2-process DDP: tests/test_resume.py)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_sentemb.callbacks.kmeans import KMeansCallback
from lightning_sentemb.cli import main
from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.loading import load_method
from lightning_sentemb.methods import ClusterNS, ClusterNSPrefix, ClusterNSPrompt
from lightning_sentemb.methods.building import build_method

REPO = Path(__file__).resolve().parents[1]
STATE_KEYS = {"cluster_state.centroids", "cluster_state.initialized", "cluster_state.num_updates"}
CURVES = [
    "train/sim/positive", "train/sim/in_batch_negative", "train/sim/hard_negative", "train/sim/sample_centroid",
    "train/sim/intra_cluster", "train/sim/inter_centroid", "train/false_negative/pair_rate",
    "train/false_negative/sample_rate", "train/loss/info_nce", "train/loss/bml", "train/cluster/initialized",
]
WORDS = ["a man plays guitar", "the cat sleeps", "kids play football", "a woman cooks", "the sun shines",
         "birds fly south", "a car drives fast", "a dog runs"]


def fit_args(method: str, backbone: str, data: Path, root: Path, *extra: str) -> list[str]:
    """A tiny CLI fit: batch 8, K 4, σ 1 (clustering starts after the first step), γ 0.1."""
    return [
        "--model", f"lightning_sentemb.methods.{method}", "--model.backbone", backbone,
        "--model.num_clusters", "4", "--model.sigma", "1.0", "--model.gamma", "0.1", "--model.lr", "1e-3",
        "--data.data_dir", str(data), "--data.batch_size", "8", "--data.cache_dir", str(root / "cache"),
        "--trainer.default_root_dir", str(root), "--trainer.max_steps", "4", "--trainer.val_check_interval", "2",
        "--trainer.check_val_every_n_epoch", "null", "--trainer.enable_progress_bar", "false",
        "--trainer.accelerator", "cpu", "--trainer.log_every_n_steps", "1", *extra,
    ]


def logged_columns(root: Path) -> list[str]:
    with open(root / "lightning_logs" / "version_0" / "metrics.csv") as f:
        return next(csv.reader(f))


def test_fit_logs_the_curves_and_checkpoints_the_centroids(tiny_bert, sts_fixture, tmp_path):
    main(["fit", *fit_args("ClusterNS", tiny_bert, sts_fixture, tmp_path)])
    assert set(CURVES) <= set(logged_columns(tmp_path))
    best = tmp_path / "checkpoints" / "best.ckpt"
    checkpoint = torch.load(best, weights_only=False)
    assert checkpoint["sentemb_method"] == "lightning_sentemb.methods.clusterns.ClusterNS"
    assert STATE_KEYS <= set(checkpoint["state_dict"]) and checkpoint["state_dict"]["cluster_state.initialized"]
    method = load_method(str(best))
    assert isinstance(method, ClusterNS) and method.cluster_state.is_initialized
    assert method.hparams.num_clusters == 4 and method.encode(WORDS[:2]).shape == (2, 32)


def test_prompt_variant_fits_with_denoising(tiny_bert, sts_fixture, tmp_path):
    main(["fit", *fit_args("ClusterNSPrompt", tiny_bert, sts_fixture, tmp_path, "--trainer.max_steps", "2")])
    method = load_method(str(tmp_path / "checkpoints" / "best.ckpt"))
    assert isinstance(method, ClusterNSPrompt) and method.hparams.denoise_train
    assert method.cluster_state.is_initialized and int(method.cluster_state.num_updates) == 1
    assert "train/sim/hard_negative" in logged_columns(tmp_path)


# --- direct Trainer runs on a fixed, unshuffled loader ------------------------------------------


class SeedEachStep(Callback):
    """Dropout is the augmentation: reseed before every step so a resumed run draws the same masks."""

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        torch.manual_seed(trainer.global_step)


class StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


class SaveAtStart(Callback):
    """A checkpoint before the first step."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainer.save_checkpoint(self.path)


def make_method(backbone: str, **overrides) -> ClusterNS:
    torch.manual_seed(0)
    options = {"pooler": "cls", "mlp": "train", "num_clusters": 4, "sigma": 1.0, "gamma": 0.1, "lr": 1e-3} | overrides
    return build_method(ClusterNS, backbone, **options)


def loader(method: ClusterNS, examples: int = 24, batch_size: int = 8) -> DataLoader:
    """Three batches an epoch, unshuffled: a step-3 checkpoint ends an epoch (a plain DataLoader
    cannot be resumed mid-epoch: Lightning would restart its iterator at the first batch)."""
    sentences = [f"{WORDS[i % len(WORDS)]} number {i} ." for i in range(examples)]
    rows = [{"sent0": ids} for ids in method.encoder.format.sentence_ids(sentences)]
    return DataLoader(rows, batch_size=batch_size, shuffle=False, collate_fn=method.collate, drop_last=True)


def trainer(max_steps: int, *callbacks: Callback, root: Path | None = None) -> Trainer:
    return Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, callbacks=[SeedEachStep(), *callbacks], logger=False,
        enable_checkpointing=root is not None, default_root_dir=root, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0,
    )


def test_resume_from_a_checkpoint_gives_the_uninterrupted_centroids(tiny_bert, tmp_path):
    straight = make_method(tiny_bert)
    trainer(6).fit(straight, loader(straight))
    assert straight.cluster_state.is_initialized and int(straight.cluster_state.num_updates) == 5

    first = make_method(tiny_bert)
    every_3 = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=3, save_top_k=-1)
    trainer(6, every_3, StopAt(3), root=tmp_path).fit(first, loader(first))
    checkpoint = torch.load(tmp_path / "step=3.ckpt", weights_only=False)
    assert int(checkpoint["state_dict"]["cluster_state.num_updates"]) == 2  # saved after the K-means callback

    resumed = make_method(tiny_bert)
    trainer(6).fit(resumed, loader(resumed), ckpt_path=tmp_path / "step=3.ckpt")
    assert int(resumed.cluster_state.num_updates) == 5
    assert torch.equal(resumed.cluster_state.centroids, straight.cluster_state.centroids)
    for name, parameter in straight.named_parameters():
        assert torch.equal(parameter, resumed.get_parameter(name)), name


def test_every_checkpoint_holds_the_state_and_resumes_before_clustering(tiny_bert, tmp_path):
    """The reference creates its centroids at the first clustering step, so a checkpoint written
    before it cannot be resumed; here the buffers exist from step 0."""
    method = make_method(tiny_bert, sigma=-1.0)  # never initializes
    every_step = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    trainer(2, every_step, SaveAtStart(tmp_path / "start.ckpt"), root=tmp_path).fit(method, loader(method))
    for name in ("start.ckpt", "step=1.ckpt", "step=2.ckpt"):
        state = torch.load(tmp_path / name, weights_only=False)["state_dict"]
        assert STATE_KEYS <= set(state), name
        assert not state["cluster_state.initialized"] and not state["cluster_state.centroids"].any()

    resumed = make_method(tiny_bert, sigma=1.0)
    trainer(3).fit(resumed, loader(resumed), ckpt_path=tmp_path / "start.ckpt")
    assert resumed.cluster_state.is_initialized and int(resumed.cluster_state.num_updates) == 2


def test_k_larger_than_the_global_batch_fails_before_training(tiny_bert):
    method = make_method(tiny_bert, num_clusters=16)
    with pytest.raises(ValueError, match=r"K=16 is larger than the global batch \(8 x 1 devices\)"):
        trainer(2).fit(method, loader(method))
    assert method.global_step == 0


def test_global_initialization_clusters_from_the_first_step(tiny_bert):
    method = make_method(tiny_bert, num_clusters=16, sigma=-1.0, global_init_samples=20)
    trainer(1).fit(method, loader(method))  # K 16 > batch 8 is fine here
    state = method.cluster_state
    assert state.is_initialized and int(state.num_updates) == 1  # the first step was already clustered


def test_callback_is_attached_with_the_method_settings(tiny_bert):
    method = make_method(tiny_bert, sigma=0.3, gamma=5e-4, update_rule="sum")
    (callback,) = method.configure_callbacks()
    assert isinstance(callback, KMeansCallback)
    assert (callback.sigma, callback.gamma, callback.rule) == (0.3, 5e-4, "sum")


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"hard_negatives": "nearest"},
        {"hard_negatives": "none"},
        {"false_negatives": "mask"},
        {"false_negatives": "positive"},
        {"false_negatives": "none"},
        {"random_clusters": True},
        {"bml_reduction": "false_negatives"},
    ],
)
def test_ablations_reach_the_loss(tiny_bert, options):
    method = make_method(tiny_bert, **options)
    batch = next(iter(loader(method, examples=8)))
    before, _ = method.training_loss(batch)
    assert method.last_cluster_embeddings.shape == (8, 32)
    method.cluster_state.initialize_(method.last_cluster_embeddings[:4])
    loss, stats = method.training_loss(batch)
    assert torch.isfinite(loss) and stats["cluster/initialized"] == 1
    assert ("loss/bml" in stats) == (options.get("false_negatives", "bml") == "bml")
    config = method.loss_fn.get_config_dict()
    assert all(config[k] == v for k, v in options.items() if k in config)
    assert method.cluster_state.random_clusters == options.get("random_clusters", False)
    assert torch.isfinite(before)


def test_supervised_triplets_are_refused(tiny_bert):
    method = make_method(tiny_bert)
    with pytest.raises(ValueError, match="unsupervised"):
        method.embedding_loss(torch.zeros(6, method.output_size), {"num_views": 3})


def test_prefix_variant_trains_only_the_prefix_and_checkpoints_the_centroids(tiny_bert):
    """ClusterNS on DCPCSE: the clustering loss reaches the prefix (and MLP) only, and the
    trainable-only checkpoint keeps the centroids."""
    method = build_method(ClusterNSPrefix, tiny_bert, num_clusters=2, prefix_len=2)
    method.cluster_state.initialize_(torch.randn(2, method.output_size))
    batch = method.collate([{"sent0": ids} for ids in method.encoder.format.sentence_ids(WORDS)])
    loss, stats = method.training_loss(batch)
    loss.backward()
    assert stats["cluster/initialized"] == 1 and stats["loss/bml"] > 0
    assert method.encoder.prefixed.prefix_encoder.embedding.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in method.encoder.backbone.parameters())
    checkpoint = {"state_dict": method.state_dict()}
    method.on_save_checkpoint(checkpoint)
    assert STATE_KEYS <= set(checkpoint["state_dict"])
    assert not any(k.startswith("encoder.backbone.") for k in checkpoint["state_dict"])
    with pytest.raises(SentEmbUserError, match="hinge_weight"):
        build_method(ClusterNSPrefix, tiny_bert, hinge_weight=10.0)


# --- slow: DDP and the demo -----------------------------------------------------------------------


class DumpCentroids(Callback):
    """Each rank saves its centroid state at the end of the fit (tests/test_resume.py's torchrun run: the ranks'
    centroids are the same)."""

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        state = {k: v.clone() for k, v in pl_module.cluster_state.state_dict().items()}
        torch.save(state, Path(trainer.default_root_dir) / f"rank{trainer.global_rank}.pt")


@pytest.mark.slow
def test_demo_config_fits(shared_data, tmp_path, monkeypatch):
    monkeypatch.setenv("SENTEMB_DATA", str(shared_data))
    main(["fit", "-c", str(REPO / "experiments" / "demo" / "clusterns.yaml"), "--trainer.max_steps", "3",
          "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "1",
          "--trainer.default_root_dir", str(tmp_path), "--trainer.log_every_n_steps", "1",
          "--data.cache_dir", str(tmp_path / "cache"), "--data.max_train_examples", "256",
          "--data.val_tasks", "[STSBenchmark-dev]", "--data.batch_size", "32", "--data.eval_batch_size", "64",
          "--trainer.precision", "32-true"])
    assert (tmp_path / "checkpoints" / "best.ckpt").exists()
    assert "train/cluster/initialized" in logged_columns(tmp_path)
