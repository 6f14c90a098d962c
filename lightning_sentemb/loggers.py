"""Loggers on by default: CSV always, W&B offline unless the user has configured W&B; a resumed fit
continues the CSV version and the W&B run of the run it resumes."""

from __future__ import annotations

import csv
import io
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from transformers.utils import logging as transformers_logging

from .atomic_io import atomic_write_text

# where a checkpoint keeps the run's logger ids (`LoggerIds`)
LOGGER_IDS_KEY = "sentemb_loggers"


def wandb_configured() -> bool:
    """W&B goes online only when the user asked for it (WANDB_MODE=online, an API key, or a run
    started by `wandb agent`, which sets WANDB_SWEEP_ID and reads its results from the server)."""
    return (os.environ.get("WANDB_MODE") == "online" or bool(os.environ.get("WANDB_API_KEY"))
            or bool(os.environ.get("WANDB_SWEEP_ID")))


@dataclass(frozen=True)
class ResumedRun:
    """What a resumed fit continues: the loggers' ids its checkpoint recorded (`LoggerIds`) and the
    checkpoint's step."""

    ids: dict[str, Any]
    step: int


def default_loggers(save_dir: str, resumed: ResumedRun | None = None) -> list[Logger]:
    """CSV always, plus W&B (offline unless configured) unless WANDB_MODE=disabled.

    Offline W&B runs land in `save_dir/wandb` and can be uploaded later with `wandb sync`; W&B prints
    nothing then (the fit's summary names the run). A resumed run writes on in the same CSV version
    (without the rows logged after its checkpoint, which it trains again) and the same W&B run
    (`resume="allow"`, same id), so one run stays one run.
    """
    ids = resumed.ids if resumed else {}
    csv_logger = (ContinuedCSVLogger(save_dir, ids["csv"], resumed.step) if "csv" in ids else CSVLogger(save_dir))
    loggers: list[Logger] = [csv_logger]
    if os.environ.get("WANDB_MODE") != "disabled":
        # W&B looks for the git repository from its folder and warns "git root ... does not exist"
        # when that folder is not there yet.
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        import wandb

        same_run = {"id": ids["wandb"], "resume": "allow"} if "wandb" in ids else {}
        offline = not wandb_configured()
        # offline, W&B's own lines (where the run is, how to upload it) come at exit, after the fit's
        # summary, which gives the same (console.fit_summary): W&B stays silent
        quiet = {"settings": wandb.Settings(silent=True)} if offline else {}
        wandb_logger = WandbLogger(project="lightning_sentemb", save_dir=save_dir, offline=offline, **same_run, **quiet)
        # Lightning always passes `anonymous`, which W&B no longer uses and warns about on every run.
        wandb_logger._wandb_init.pop("anonymous", None)
        loggers.append(wandb_logger)
    return loggers


class LoggerIds(Callback):
    """Records the CSV version and the W&B run id in every checkpoint, for `resumed_run`."""

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        ids = {}
        for logger in trainer.loggers:
            if isinstance(logger, CSVLogger):
                ids["csv"] = logger.version
            elif isinstance(logger, WandbLogger):
                ids["wandb"] = logger.version
        checkpoint[LOGGER_IDS_KEY] = ids


def resumed_run(checkpoint: dict[str, Any]) -> ResumedRun:
    """The `ResumedRun` of a checkpoint's contents (no ids when `LoggerIds` did not write it)."""
    return ResumedRun(checkpoint.get(LOGGER_IDS_KEY, {}), int(checkpoint.get("global_step", 0)))


class ContinuedExperimentWriter(ExperimentWriter):
    """Writes on in an existing `metrics.csv`: keeps its rows up to `step` (Lightning's writer deletes
    the file of an existing version) and its columns."""

    def __init__(self, log_dir: str, step: int) -> None:
        self.resume_step = step
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:
        """Called by the base class where it would delete the file: keep the rows of steps the resumed
        run does not train again."""
        path = Path(self.metrics_file_path)
        if not path.is_file():
            return
        with path.open(newline="") as file:
            reader = csv.DictReader(file)
            self.metrics_keys = list(reader.fieldnames or [])
            rows = [row for row in reader if int(row["step"]) < self.resume_step]
        kept = io.StringIO()
        writer = csv.DictWriter(kept, fieldnames=self.metrics_keys)
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_text(path, kept.getvalue())


class ContinuedCSVLogger(CSVLogger):
    """`CSVLogger` of a resumed run: the interrupted run's version, continued (`ContinuedExperimentWriter`)."""

    def __init__(self, save_dir: str, version: int | str, step: int) -> None:
        super().__init__(save_dir, version=version)
        self.resume_step = step

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = ContinuedExperimentWriter(self.log_dir, self.resume_step)
        return self._experiment


class LogFullConfig(SaveConfigCallback):
    """LightningCLI's `config.yaml` in the run dir, and the same resolved config (seed, trainer,
    checkpoint, model, data) logged as every logger's hyperparameters, so a W&B run alone says how
    to reproduce it (Lightning itself logs only the model's and data module's arguments)."""

    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        config = yaml.safe_load(self.parser.dump(self.config, skip_none=False))
        for logger in trainer.loggers:
            logger.log_hyperparams(config)


def silence_known_noise() -> None:
    """Drop the third-party messages every run prints that say nothing about this run, each matched
    by its own text (so anything new still shows)."""
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    warnings.filterwarnings("ignore", message=r"Precision \S+ is not supported by the model summary")
    # a fit into a folder with checkpoints is refused or resumed before Lightning looks (SentEmbCLI)
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
    transformers_logging.disable_progress_bar()  # the per-tensor "Loading weights" bar of every model load
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_not_lightning_noise)


LIGHTNING_NOISE = (
    "💡 Tip",  # Lightning's advertisements for litlogger / litmodels
    "Trainer already configured with model summary callbacks",  # ours replaces its default (no FLOPs column)
)


def _not_lightning_noise(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(LIGHTNING_NOISE)
