"""The training progress bar: readable small losses, no bogus epoch total, the selection score."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import RichProgressBarTheme


TRAINING_LOSS = "train/loss"


class SentEmbProgressBar(RichProgressBar):
    """Lightning's Rich bar with three significant digits (a loss of 6.7e-4 shows as 0.00067, not
    0.000), "Epoch N" alone when the run is bounded by steps (Lightning shows "Epoch 0/-2"), the
    training loss of the latest log step (every `log_every_n_steps` steps) and the latest value of
    `monitor` (STS-B dev) once a validation has run."""

    def __init__(self, monitor: str, monitor_label: str = "STS-B dev") -> None:
        super().__init__(theme=RichProgressBarTheme(metrics_format=".3g"))
        self.monitor = monitor
        self.monitor_label = monitor_label
        self.shown: dict[str, float] = {}

    def _get_train_description(self, current_epoch: int) -> str:
        max_epochs = self.trainer.max_epochs
        description = f"Epoch {current_epoch}" + (f"/{max_epochs - 1}" if max_epochs is not None and max_epochs > 0 else "")
        return f"{description:{len(self.validation_description)}}"  # padded like Lightning's, against flicker

    # Values are read back from the device only when they change: the training loss every
    # `log_every_n_steps` steps (when the loggers get it), the score after each validation. A read
    # on every refresh would make every training step wait for the GPU.
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step % trainer.log_every_n_steps == 0:
            self.read_metric(trainer, TRAINING_LOSS, TRAINING_LOSS)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self.read_metric(trainer, self.monitor, self.monitor_label)
        super().on_validation_end(trainer, pl_module)

    def read_metric(self, trainer: Trainer, name: str, label: str) -> None:
        value = trainer.callback_metrics.get(name)
        if value is not None:
            self.shown[label] = float(value)

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        return {**super().get_metrics(trainer, pl_module), **self.shown}
