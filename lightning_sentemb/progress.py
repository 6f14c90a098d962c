"""The training progress bar: readable small losses, no bogus epoch total, the selection score."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import RichProgressBarTheme


class SentEmbProgressBar(RichProgressBar):
    """Lightning's Rich bar with three significant digits (a loss of 6.7e-4 shows as 0.00067, not
    0.000), "Epoch N" alone when the run is bounded by steps (Lightning shows "Epoch 0/-2"), and
    the latest value of `monitor` (STS-B dev) once a validation has run."""

    def __init__(self, monitor: str, monitor_label: str = "STS-B dev") -> None:
        super().__init__(theme=RichProgressBarTheme(metrics_format=".3g"))
        self.monitor = monitor
        self.monitor_label = monitor_label

    def _get_train_description(self, current_epoch: int) -> str:
        max_epochs = self.trainer.max_epochs
        description = f"Epoch {current_epoch}" + (f"/{max_epochs - 1}" if max_epochs is not None and max_epochs > 0 else "")
        return f"{description:{len(self.validation_description)}}"  # padded like Lightning's, against flicker

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        score = trainer.callback_metrics.get(self.monitor)
        if score is not None:
            metrics[self.monitor_label] = float(score)
        return metrics
