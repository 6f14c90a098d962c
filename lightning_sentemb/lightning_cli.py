"""The LightningCLI entry (fit/validate/test/predict) with the shared checkpointing.

Its own module so `cli`, `sweep` and `reproduce` can all import it without a cycle.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import Callback, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from .callbacks.run_state import AtomicCheckpointIO, SentEmbCheckpoint, TrainingGuard
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
    """LightningCLI in omegaconf mode with the shared checkpointing (`best.ckpt` by STS-B dev,
    `last.ckpt` to resume from), atomic checkpoint writes, and the divergence guard."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(SentEmbCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.monitor": SELECTION_METRIC, "checkpoint.mode": "max", "checkpoint.filename": "best"})
        parser.add_argument("--overwrite", type=bool, default=False,
                            help="fit: delete the checkpoints of an earlier run in this root dir first")
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
        plugins = config.get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        if not any(isinstance(plugin, CheckpointIO) for plugin in plugins):
            kwargs["plugins"] = [*plugins, AtomicCheckpointIO()]
        return super().instantiate_trainer(**kwargs)

    def _resolve_last(self) -> None:
        """`--ckpt_path last`: `<default_root_dir>/checkpoints/last.ckpt`, in any process. A fit with
        no checkpoint at all there starts from step 0 (so a requeued job can always pass it)."""
        config = self.config_init[self.subcommand]
        if config.get("ckpt_path") != "last":
            return
        callback = self.trainer.checkpoint_callback
        last = callback.last_path
        if last.exists():
            config["ckpt_path"] = str(last)
        elif self.subcommand == "fit" and not list(Path(callback.dirpath).glob("*.ckpt")):
            rank_zero_info(f"--ckpt_path last: no checkpoint in {callback.dirpath} yet, starting from step 0")
            config["ckpt_path"] = None
        else:
            raise SentEmbUserError(f"--ckpt_path last: {last} does not exist; run `sentemb fit` with this config "
                                   "(and --trainer.default_root_dir) first")

    def _refuse_stale_checkpoints(self) -> None:
        """A new fit never leaves an earlier run's checkpoints looking like its own."""
        config = self.config_init[self.subcommand]
        if config.get("ckpt_path") is not None:
            return
        folder = Path(self.trainer.checkpoint_callback.dirpath)
        stale = sorted(folder.glob("*.ckpt"))
        if not stale:
            return
        if not config.get("overwrite"):
            raise SentEmbUserError(
                f"{folder} holds checkpoints of an earlier run ({', '.join(p.name for p in stale)}): resume it with "
                "--ckpt_path last, or choose another --trainer.default_root_dir, or pass --overwrite true to delete them"
            )
        if self.trainer.is_global_zero:
            for path in stale:
                path.unlink(missing_ok=True)
            rank_zero_info(f"--overwrite: deleted {len(stale)} checkpoint(s) of an earlier run in {folder}")

    def before_fit(self) -> None:
        self.datamodule.check_data("fit")
        self._resolve_last()
        self._refuse_stale_checkpoints()

    def _resolve_best(self) -> None:
        """`--ckpt_path best` in a fresh process: the best checkpoint of an earlier `fit`."""
        config = self.config[self.subcommand]
        callback = self.trainer.checkpoint_callback
        if config.get("ckpt_path") == "best" and callback is not None and not callback.best_model_path:
            best = Path(callback.dirpath) / "best.ckpt"
            if not best.exists():
                raise SentEmbUserError(f"--ckpt_path best: {best} does not exist; run `sentemb fit` with this config first")
            callback.best_model_path = str(best)

    def before_test(self) -> None:
        self.datamodule.check_data("test")
        self._resolve_last()
        self._resolve_best()

    def before_validate(self) -> None:
        self.datamodule.check_data("validate")
        self._resolve_last()
        self._resolve_best()


def lightning_main(args: list[str] | None, callbacks: Sequence[Callback] = ()) -> SentEmbCLI:
    """Run a LightningCLI subcommand; `callbacks` join the config's (`sentemb sweep` tracks its metric so).

    A fit stopped by SIGTERM or Ctrl-C (after saving last.ckpt) exits with status 143, not 0.
    """
    silence_known_noise()
    torch.serialization.add_safe_globals(SAFE_GLOBALS)  # `--ckpt_path` loads with weights_only=True as well
    try:
        return SentEmbCLI(
            SentEmbMethod,
            SentEmbDataModule,
            subclass_mode_model=True,
            parser_kwargs={"parser_mode": "omegaconf"},
            save_config_callback=LogFullConfig,
            # the run's config.yaml may be replaced: a resume rewrites it, and a new fit over an earlier
            # run's checkpoints is refused (or --overwrite) before it is written
            save_config_kwargs={"overwrite": True},
            trainer_defaults={"default_root_dir": "out", "log_every_n_steps": LOG_EVERY_N_STEPS,
                              "callbacks": [*callbacks, TrainingGuard(SELECTION_METRIC)]},
            args=args,
        )
    except SIGTERMException:
        raise SystemExit(143) from None
