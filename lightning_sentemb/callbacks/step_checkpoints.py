"""A checkpoint every N optimizer steps, all kept, beside the run's best.ckpt and last.ckpt."""

from __future__ import annotations

import os

from lightning.pytorch import LightningModule, Trainer

from .checkpointing import GuardedCheckpoint

__all__ = ["StepCheckpoints"]


class StepCheckpoints(GuardedCheckpoint):
    """`step=N.ckpt` every `every_n_train_steps` steps in `<default_root_dir>/checkpoints`, where
    `sentemb fit` keeps best.ckpt and last.ckpt: a new fit into the same root dir refuses them as
    an earlier run's (or deletes them with `--overwrite true`), and a resumed run that trains a step
    again overwrites its file. Like every checkpoint of a fit, none is written from a non-finite
    step on.

    Args:
        every_n_train_steps: steps between two checkpoints.
        dirpath: another folder for them.
    """

    def __init__(self, every_n_train_steps: int = 1000, dirpath: str | None = None) -> None:
        super().__init__(dirpath=dirpath, filename="{step}", every_n_train_steps=every_n_train_steps, save_top_k=-1,
                         enable_version_counter=False)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.dirpath is None:
            self.dirpath = os.path.join(trainer.default_root_dir, "checkpoints")
        super().setup(trainer, pl_module, stage)
