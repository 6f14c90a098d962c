"""Loggers on by default: CSV always, W&B offline unless the user has configured W&B."""

from __future__ import annotations

import os

from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger


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
        loggers.append(WandbLogger(project="lightning_sentemb", save_dir=save_dir, offline=not wandb_configured()))
    return loggers
