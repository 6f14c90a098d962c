"""The training guard: a diverged run (NaN or inf loss) stops with one line at the next decision point
and no checkpoint ever holds a diverged state; a collapsed one (loss at ln of the in-batch candidates,
validation below its start) is warned about."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule

from lightning_sentemb.callbacks.checkpointing import AtomicCheckpointIO
from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.lightning_cli import lightning_main
from tests.test_resume import checkpoint_step, short_fit_args


def test_divergence_stops_the_run_and_is_never_checkpointed(tiny_bert, sts_fixture, tmp_path):
    args = short_fit_args(tiny_bert, sts_fixture, tmp_path, "--model.lr", "1e30", "--trainer.max_steps", "8",
                          "--checkpoint.every_n_train_steps", "1")
    with pytest.raises(SentEmbUserError, match=r"training diverged: loss (nan|inf) at step \d+.*--model.lr.*precision"):
        lightning_main(["fit", *args])
    for path in (tmp_path / "checkpoints").glob("*.ckpt"):
        state = torch.load(path, weights_only=False)["state_dict"]
        assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point()), path.name


class DivergesAt(LightningModule):
    """A linear model whose loss is NaN at one step (the weights are NaN from then on)."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.diverging_step = step

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        return loss * float("nan") if self.global_step + 1 == self.diverging_step else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(("log_every", "save_every", "seen_at"), [(5, None, 5), (100, 2, 4), (0, None, 3)],
                         ids=["at a log step", "before a checkpoint", "log_every_n_steps 0: every step"])
def test_divergence_is_read_back_at_a_decision_point_and_never_checkpointed(log_every, save_every, seen_at, tmp_path):
    """The NaN of step 3 is found at the next log step, or before the next checkpoint write; the line
    names both steps, and no checkpoint holds step 3 or later."""
    from lightning import Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_sentemb.callbacks.checkpointing import SentEmbCheckpoint, TrainingGuard

    trainer = Trainer(max_steps=8, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, log_every_n_steps=log_every,
                      plugins=[AtomicCheckpointIO()],
                      callbacks=[TrainingGuard("val/score"),
                                 SentEmbCheckpoint(str(tmp_path), every_n_train_steps=save_every)])
    data = DataLoader(TensorDataset(torch.randn(16, 2)), batch_size=2)
    with pytest.raises(SentEmbUserError, match=rf"training diverged: loss nan at step 3 \(seen at step {seen_at}; "
                                               r"no checkpoint holds a later state than step 2\)"):
        trainer.fit(DivergesAt(3), data)
    assert trainer.global_step == seen_at
    saved = [checkpoint_step(path) for path in tmp_path.glob("*.ckpt")]
    assert saved == ([2] if save_every else [])


def test_a_step_checkpoint_preset_never_holds_a_diverged_state(tmp_path):
    """`callbacks/step_checkpoints.yaml` saves every 2 steps, the guard decides every 100: the NaN of
    step 3 is found before step 4's file is written."""
    from lightning import Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_sentemb.callbacks.checkpointing import TrainingGuard
    from lightning_sentemb.callbacks.step_checkpoints import StepCheckpoints

    trainer = Trainer(max_steps=8, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, log_every_n_steps=100,
                      plugins=[AtomicCheckpointIO()],
                      callbacks=[TrainingGuard("val/score"), StepCheckpoints(2, dirpath=str(tmp_path))])
    data = DataLoader(TensorDataset(torch.randn(16, 2)), batch_size=2)
    with pytest.raises(SentEmbUserError, match=r"loss nan at step 3 \(seen at step 4;"):
        trainer.fit(DivergesAt(3), data)
    assert sorted(path.name for path in tmp_path.glob("*.ckpt")) == ["step=2.ckpt"]


def test_collapse_warning(recwarn):
    import math
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import TrainerFn

    from lightning_sentemb.callbacks.checkpointing import TrainingGuard

    guard = TrainingGuard("val/STS")
    trainer = SimpleNamespace(global_step=10, log_every_n_steps=50, world_size=2, sanity_checking=False,
                              callback_metrics={},
                              state=SimpleNamespace(fn=TrainerFn.FITTING),
                              strategy=SimpleNamespace(reduce_boolean_decision=lambda decision, all: decision))
    batch = {"num_views": 2, "batch_size": 8}

    def step_then_validate(loss: float, score: float) -> bool:
        guard.on_train_batch_end(trainer, None, {"loss": torch.tensor(loss)}, batch, 0)
        trainer.callback_metrics = {"val/STS": torch.tensor(score)}
        recwarn.clear()
        guard.on_validation_end(trainer, None)
        return any("collapsed" in str(w.message) for w in recwarn)

    assert not step_then_validate(1.0, 60.0)  # the start: 60
    assert step_then_validate(math.log(16), 40.0)  # loss at ln(8 x 2 ranks), below the start
    assert not step_then_validate(math.log(16), 70.0)  # loss at ln B but above the start
    assert not step_then_validate(1.0, 40.0)  # worse, but the loss is not the collapsed one
