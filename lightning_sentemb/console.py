"""What a fit prints: the progress bar (Rich on a terminal, plain lines in a log file), the model
summary, and the summary at its end; tqdm bars that write whole lines to a log file."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar, RichModelSummary, RichProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import RichProgressBarTheme
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.model_summary.model_summary import get_formatted_model_size, get_human_readable_count
from tqdm.auto import tqdm

from .callbacks.checkpointing import SentEmbCheckpoint
from .distributed import at_decision_step

TRAINING_LOSS = "train/loss"


def epoch_total(trainer: Trainer) -> int | float:
    """The batch of this epoch at which it ends or the run does. A bar counts batches from the epoch's
    start, also in a resumed epoch, where Lightning's total (the steps left) would read 40/32."""
    total = trainer.num_training_batches
    if trainer.max_steps is None or trainer.max_steps < 0 or total == float("inf"):
        return total
    in_epoch = trainer.fit_loop.epoch_loop.batch_progress.total.processed - trainer.current_epoch * total
    remaining = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
    return min(total, in_epoch + remaining)


class SentEmbProgressBar(RichProgressBar):
    """Lightning's Rich bar with three significant digits (a loss of 6.7e-4 shows as 0.00067, not
    0.000), "Epoch N" alone when the run is bounded by steps (Lightning shows "Epoch 0/-2"), the
    training loss of the latest log step (every `log_every_n_steps` steps), the latest value of
    `monitor` (STS-B dev) once a validation has run, the dataset a mixture's step drew, and the right total in
    a resumed epoch."""

    def __init__(self, monitor: str, monitor_label: str = "STS-B dev") -> None:
        super().__init__(theme=RichProgressBarTheme(metrics_format=".3g"))
        self.monitor = monitor
        self.monitor_label = monitor_label
        self.shown: dict[str, float | str] = {}

    def _get_train_description(self, current_epoch: int) -> str:
        max_epochs = self.trainer.max_epochs
        description = f"Epoch {current_epoch}"
        if max_epochs is not None and max_epochs > 0:
            description += f"/{max_epochs - 1}"
        return f"{description:{len(self.validation_description)}}"  # padded like Lightning's, against flicker

    @property
    def total_train_batches(self) -> int | float:
        return epoch_total(self.trainer)

    # Values are read back from the device only when they change: the training loss every
    # `log_every_n_steps` steps (when the loggers get it), the score after each validation. A read
    # on every refresh would make every training step wait for the GPU.
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if at_decision_step(trainer):
            self.read_metric(trainer, TRAINING_LOSS, TRAINING_LOSS)
        if (dataset := drawn_dataset(batch)) is not None:
            self.shown["dataset"] = dataset
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


class PlainProgress(ProgressBar):
    """The progress of a fit as plain lines, for a log file (nohup, SLURM), where a Rich bar shows only
    at the end: one line every `every_n_steps` optimizer steps (default 10 × `log_every_n_steps`) and
    whenever `every_seconds` have passed, with the step, the training loss of the latest log step,
    sentences/s and the ETA; one line after each validation with STS-B dev. `sentemb fit` uses it in
    place of the Rich bar when stdout is not a terminal.

        step 120/1000 · loss 0.0123 · 410 sentences/s · elapsed 4:52 · ETA 35:41

    The loss is read back from the device only when a line is printed (once per 30 s at most between
    the N-step lines), never on the other steps."""

    def __init__(self, every_n_steps: int | None = None, every_seconds: float = 30.0,
                 monitor: str = "val/STSBenchmark-dev", monitor_label: str = "STS-B dev") -> None:
        super().__init__()
        self.every_n_steps, self.every_seconds = every_n_steps, every_seconds
        self.monitor, self.monitor_label = monitor, monitor_label
        self._enabled = True
        self._start = self._last_line = 0.0
        self._first_step = 0
        self._sentences = 0
        self._dataset: str | None = None

    @property
    def total_train_batches(self) -> int | float:
        return epoch_total(self.trainer)

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start = self._last_line = time.monotonic()
        self._first_step, self._sentences = trainer.global_step, 0

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._sentences += _examples_in(batch) * trainer.world_size  # shapes only: no device read
        self._dataset = drawn_dataset(batch)
        every_n = self.every_n_steps or 10 * max(trainer.log_every_n_steps, 1)
        now = time.monotonic()
        if trainer.global_step % every_n == 0 or now - self._last_line >= self.every_seconds:
            self._print_step(trainer, now)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._print_step(trainer, time.monotonic())

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        score = trainer.callback_metrics.get(self.monitor)
        if not trainer.sanity_checking and trainer.state.fn == "fit" and score is not None:
            self._line(f"validation at step {trainer.global_step}: {self.monitor_label} {float(score):.2f}")

    def _print_step(self, trainer: Trainer, now: float) -> None:
        self._last_line = now
        elapsed = now - self._start
        done = trainer.global_step - self._first_step
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else trainer.estimated_stepping_batches
        parts = [f"step {trainer.global_step}" + (f"/{int(total)}" if total != float("inf") else "")]
        loss = trainer.callback_metrics.get(TRAINING_LOSS)
        if loss is not None:
            parts.append(f"loss {float(loss):.4g}")
        if self._dataset is not None:
            parts.append(f"dataset {self._dataset}")
        if elapsed > 0 and done > 0:
            parts.append(f"{self._sentences / elapsed:,.0f} sentences/s")
        parts.append(f"elapsed {_clock(elapsed)}")
        if done > 0 and total != float("inf"):
            parts.append(f"ETA {_clock(elapsed / done * max(total - trainer.global_step, 0))}")
        self._line(" · ".join(parts))

    @rank_zero_only
    def _line(self, text: str) -> None:
        if self._enabled:
            print(text, flush=True)


def drawn_dataset(batch: Any) -> str | None:
    """The name of the dataset a mixture's batch came from (`batch["dataset"]`, host-side), else None."""
    return batch["dataset"].name if isinstance(batch, dict) and "dataset" in batch else None


def _examples_in(batch: Any) -> int:
    """Training examples in a batch as `collate` builds it (rows / views unless it says)."""
    if isinstance(batch, dict) and "features" in batch:
        return batch.get("batch_size") or batch["features"]["input_ids"].size(0) // batch["num_views"]
    return 0


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class PlainLines(tqdm):
    """tqdm for a log file: its status as a whole line (no carriage returns) every 30 s and when done."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "mininterval": 30.0, "maxinterval": 30.0, "ascii": True, "leave": False})

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        self.fp.write(f"{self}\n")
        self.fp.flush()
        return True


def progress_bar(*args: Any, **kwargs: Any) -> tqdm:
    """tqdm's bar on a terminal, `PlainLines` when its output (stderr) goes to a file."""
    file = kwargs.get("file") or sys.stderr
    return tqdm(*args, **kwargs) if file.isatty() else PlainLines(*args, **kwargs)


class SentEmbModelSummary(RichModelSummary):
    """Lightning's Rich model summary without its FLOPs column and total, which read 0 here (they are
    counted only for a module with an `example_input_array`)."""

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int = 0,
        **summarize_kwargs: Any,
    ) -> None:
        from rich import get_console
        from rich.table import Table

        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for name, _ in columns:
            table.add_column(name, justify="right" if name in ("Params", "In sizes", "Out sizes") else "left")
        for row in zip(*(values for _, values in columns), strict=True):
            table.add_row(*row)
        totals = Table.grid()
        for label, value in [
            ("Trainable params", get_human_readable_count(trainable_parameters)),
            ("Non-trainable params", get_human_readable_count(total_parameters - trainable_parameters)),
            ("Total params", get_human_readable_count(total_parameters)),
            ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
        ]:
            totals.add_row(f"[bold]{label}[/]: {value}")
        console = get_console()
        console.print(table)
        console.print(totals)


def fit_summary(trainer: Trainer, checkpoint: SentEmbCheckpoint, monitor_label: str = "STS-B dev") -> str:
    """The end of `sentemb fit`: the best score and its step, where the checkpoints and metrics are,
    and the next commands with those paths."""
    from .checkpoint_file import read_checkpoint

    lines = [f"fit done: {trainer.global_step} steps."]
    best = checkpoint.best_model_path
    if best and checkpoint.best_model_score is not None:
        step = read_checkpoint(best, mmap=True).get("global_step", "?")
        lines[0] += f" Best {monitor_label} {float(checkpoint.best_model_score):.2f} at step {step}."
    files = [("best.ckpt", best), ("last.ckpt", str(checkpoint.last_path))]
    files += [("metrics.csv", logger.experiment.metrics_file_path) for logger in trainer.loggers
              if isinstance(logger, CSVLogger)]
    # a resumed run continues the same W&B run (same id) in a new offline folder: every one is named
    offline = [logger for logger in trainer.loggers if isinstance(logger, WandbLogger) and logger.experiment.offline]
    offline_runs = [str(folder) for logger in offline for folder in
                    sorted(Path(logger.experiment.dir).parent.parent.glob(f"offline-run-*-{logger.version}"))]
    files = [(name, path) for name, path in files if path and Path(path).is_file()]
    files += [("W&B run", run) for run in offline_runs]
    width = max((len(name) for name, _ in files), default=0)
    lines += [f"  {name:{width}}  {_shown(path)}" for name, path in files]
    if best and Path(best).is_file():
        export_dir = _shown(str(Path(best).parent.parent / "export"))
        lines += ["next:", f"  sentemb evaluate --model {_shown(best)} --tasks sts",
                  f"  sentemb export {_shown(best)} {export_dir}"]
        lines += [f"  wandb sync {_shown(run)}    (upload the offline W&B run)" for run in offline_runs]
    return "\n".join(lines)


def _shown(path: str) -> str:
    """`path` relative to the working directory when it lies below it (as the user typed it)."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def disk_usage_line(folder: Path, kept: str) -> str:
    """`<folder>: 812 MB on disk (<kept>)`: what a sweep or reproduce leaves behind."""
    size = sum(path.stat().st_size for path in Path(folder).rglob("*") if path.is_file())
    return f"{_shown(str(folder))}: {size / 1e6:,.0f} MB on disk ({kept})"
