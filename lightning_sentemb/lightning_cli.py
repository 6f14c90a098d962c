"""The LightningCLI entry (fit/validate/test/predict) with the shared checkpointing.

Its own module so `cli`, `sweep` and `reproduce` can all import it without a cycle.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from .data.datamodule import SentEmbDataModule
from .errors import SentEmbUserError
from .loading import SAFE_GLOBALS
from .loggers import LogFullConfig, default_loggers, silence_known_noise
from .methods.base import SentEmbMethod
from .progress import SentEmbProgressBar

SELECTION_METRIC = "val/STSBenchmark-dev"
# Lightning's 50 logs a 60-step demo's loss once; 10 gives a curve and is negligible in long runs.
LOG_EVERY_N_STEPS = 10


class SentEmbCLI(LightningCLI):
    """LightningCLI in omegaconf mode with the shared checkpointing (best STS-B dev)."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults(
            {
                "checkpoint.monitor": SELECTION_METRIC,
                "checkpoint.mode": "max",
                "checkpoint.filename": "best",
                "checkpoint.save_top_k": 1,
                "checkpoint.enable_version_counter": False,
            }
        )
        parser.link_arguments(
            "trainer.default_root_dir", "checkpoint.dirpath", compute_fn=lambda root: os.path.join(root or ".", "checkpoints")
        )
        # One source of truth: the method's `encode` batch follows the data module's evaluation
        # batch (two different values made Lightning stop with "Error while merging hparams").
        parser.link_arguments("data.eval_batch_size", "model.init_args.eval_batch_size")

    def instantiate_trainer(self, **kwargs):
        """Default loggers (CSV + W&B) under the run's root dir when the config names none, and our
        progress bar when the config names none."""
        config = self._get(self.config_init, "trainer", default={})
        if config.get("logger") in (None, True):
            kwargs["logger"] = default_loggers(config.get("default_root_dir") or "out")
        callbacks = config.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            kwargs["callbacks"] = [*callbacks, SentEmbProgressBar(SELECTION_METRIC)]
        return super().instantiate_trainer(**kwargs)

    def _resolve_best(self) -> None:
        """`--ckpt_path best` in a fresh process: the best checkpoint of an earlier `fit`."""
        config = self.config[self.subcommand]
        callback = self.trainer.checkpoint_callback
        if config.get("ckpt_path") == "best" and callback is not None and not callback.best_model_path:
            best = Path(callback.dirpath) / "best.ckpt"
            if not best.exists():
                raise SentEmbUserError(f"--ckpt_path best: {best} does not exist; run `sentemb fit` with this config first")
            callback.best_model_path = str(best)

    def before_fit(self) -> None:
        self.datamodule.check_data("fit")

    def before_test(self) -> None:
        self.datamodule.check_data("test")
        self._resolve_best()

    def before_validate(self) -> None:
        self.datamodule.check_data("validate")
        self._resolve_best()


def lightning_main(args: list[str] | None, callbacks: Sequence[Callback] = ()) -> SentEmbCLI:
    """Run a LightningCLI subcommand; `callbacks` join the config's (`sentemb sweep` tracks its metric so)."""
    silence_known_noise()
    torch.serialization.add_safe_globals(SAFE_GLOBALS)  # `--ckpt_path` loads with weights_only=True as well
    return SentEmbCLI(
        SentEmbMethod,
        SentEmbDataModule,
        subclass_mode_model=True,
        parser_kwargs={"parser_mode": "omegaconf"},
        save_config_callback=LogFullConfig,
        trainer_defaults={"default_root_dir": "out", "log_every_n_steps": LOG_EVERY_N_STEPS,
                          "callbacks": list(callbacks)},
        args=args,
    )
