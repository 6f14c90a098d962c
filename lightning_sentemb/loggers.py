"""Loggers on by default: CSV always, W&B offline unless the user has configured W&B."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

import yaml
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger
from transformers.utils import logging as transformers_logging


def wandb_configured() -> bool:
    """W&B goes online only when the user asked for it (WANDB_MODE=online, an API key, or a run
    started by `wandb agent`, which sets WANDB_SWEEP_ID and reads its results from the server)."""
    return (os.environ.get("WANDB_MODE") == "online" or bool(os.environ.get("WANDB_API_KEY"))
            or bool(os.environ.get("WANDB_SWEEP_ID")))


def default_loggers(save_dir: str) -> list[Logger]:
    """CSV always, plus W&B (offline unless configured) unless WANDB_MODE=disabled.

    Offline W&B runs land in `save_dir/wandb` and can be uploaded later with `wandb sync`.
    """
    loggers: list[Logger] = [CSVLogger(save_dir)]
    if os.environ.get("WANDB_MODE") != "disabled":
        # W&B looks for the git repository from its folder and warns "git root ... does not exist"
        # when that folder is not there yet.
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        wandb_logger = WandbLogger(project="lightning_sentemb", save_dir=save_dir, offline=not wandb_configured())
        # Lightning always passes `anonymous`, which W&B no longer uses and warns about on every run.
        wandb_logger._wandb_init.pop("anonymous", None)
        loggers.append(wandb_logger)
    return loggers


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
        logging.getLogger(name).addFilter(_not_a_lightning_tip)


def _not_a_lightning_tip(record: logging.LogRecord) -> bool:
    """Lightning's advertisements for litlogger / litmodels."""
    return not record.getMessage().startswith("💡 Tip")
