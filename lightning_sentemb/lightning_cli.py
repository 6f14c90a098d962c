"""The LightningCLI entry (fit/validate/test/predict) with the shared checkpointing.

Its own module so `cli`, `sweep` and `reproduce` can all import it without a cycle.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import Callback, ModelSummary, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from .callbacks.checkpointing import AtomicCheckpointIO, SentEmbCheckpoint, TrainingGuard
from .checkpoint_file import SAFE_GLOBALS, read_checkpoint
from .config_errors import config_files_in, describe_parse_error
from .console import PlainProgress, SentEmbModelSummary, SentEmbProgressBar, fit_summary
from .data.datamodule import SentEmbDataModule
from .data.instructions import mixture_prompts
from .distributed import decided_by_rank_zero
from .errors import SentEmbUserError
from .loggers import LogFullConfig, LoggerIds, default_loggers, resumed_run, silence_known_noise
from .methods.base import SentEmbMethod
from .precision import slow_bf16_notice, use_tf32
from .user_code import add_user_folders

SELECTION_METRIC = "val/STSBenchmark-dev"
# `checkpoint.*` as a config leaves them: best.ckpt is the best STS-B dev score (the references' selection)
CHECKPOINT_DEFAULTS = {"checkpoint.monitor": SELECTION_METRIC, "checkpoint.mode": "max", "checkpoint.filename": "best"}
# Lightning's 50 logs a 60-step demo's loss once; 10 gives a curve and is negligible in long runs.
LOG_EVERY_N_STEPS = 10


class ConfigRejected(Exception):
    """jsonargparse's report on a command line or config it rejects; `SentEmbCLI` makes it one line."""

    def __init__(self, message: str, parser: LightningArgumentParser) -> None:
        super().__init__(message)
        self.message, self.parser = message, parser


class SentEmbArgumentParser(LightningArgumentParser):
    """Reports a rejected config as `ConfigRejected` instead of a usage dump and exit."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:  # a nested parser: jsonargparse catches this and reports it in its parent's message
            super().error(message, ex)
        raise ConfigRejected(message, getattr(ex, "subcommand_parser", None) or self)


class SentEmbCLI(LightningCLI):
    """LightningCLI in omegaconf mode with the shared checkpointing (`best.ckpt` by STS-B dev,
    `last.ckpt` to resume from), atomic checkpoint writes, the divergence guard, one-line config
    errors, and a resume that continues the run's logs."""

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        try:
            super().parse_arguments(parser, args)
        except ConfigRejected as rejected:
            accepted = [action.dest for action in rejected.parser._actions]
            files = config_files_in(sys.argv[1:] if args is None else list(args))
            raise SentEmbUserError(describe_parse_error(rejected.message, accepted, files)) from None
        self._check_ckpt_path()

    def _check_ckpt_path(self) -> None:
        """`--ckpt_path FILE` read before Lightning reads it: a truncated or foreign file is one line, and
        so is a fit resumed from a lean `best.ckpt`, which holds no optimizer state."""
        subcommand = self.config.get("subcommand")
        path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if path is None or not Path(path).is_file():  # best / last: resolved to files later
            return
        checkpoint = read_checkpoint(path, mmap=True)
        if subcommand == "fit" and "optimizer_states" not in checkpoint:
            raise SentEmbUserError(
                f"--ckpt_path {path} holds the weights without the optimizer state (a best.ckpt is lean), so a fit "
                "cannot resume from it: resume with --ckpt_path last"
            )

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(SentEmbCheckpoint, "checkpoint")
        parser.set_defaults(CHECKPOINT_DEFAULTS)
        parser.add_argument("--overwrite", type=bool, default=False,
                            help="fit: delete the checkpoints of an earlier run in this root dir first")
        parser.add_argument("--tf32", type=bool, default=True,
                            help="TF32 for float32 matrix products on CUDA GPUs (no effect without CUDA)")
        parser.link_arguments(
            "trainer.default_root_dir", "checkpoint.dirpath",
            compute_fn=lambda root: os.path.join(root or ".", "checkpoints")
        )
        # One source of truth: the method's `encode` batch follows the data module's evaluation
        # batch (two different values made Lightning stop with "Error while merging hparams").
        parser.link_arguments("data.eval_batch_size", "model.init_args.eval_batch_size")
        # the instructions of data.datasets, as the method's prompts (what its export carries, docs/mixtures.md)
        parser.link_arguments(("data.datasets", "data.instruction_format"), "model.init_args.prompts",
                              compute_fn=mixture_prompts)

    @property
    def run_checkpoint(self) -> SentEmbCheckpoint:
        """The run's `best.ckpt` / `last.ckpt` callback (`checkpoint.*`); a preset may add other
        ModelCheckpoints, so Lightning's `trainer.checkpoint_callback` is not necessarily this one."""
        return self._get(self.config_init, "checkpoint")

    def instantiate_trainer(self, **kwargs):
        """Default loggers (CSV + W&B) under the run's root dir when the config names none (a resumed
        fit continues its CSV version and W&B run), our progress bar and model summary when the
        config names none."""
        config = self._get(self.config_init, "trainer", default={})
        use_tf32(self._get(self.config_init, "tf32"))  # before the Trainer checks the device's matmul precision
        if self.subcommand in ("fit", "validate", "test"):
            self.datamodule.check_data(self.subcommand)  # missing data: before the loggers make the run folder
        self._resolve_last()
        callbacks = config.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, list) else [callbacks]
        if config.get("logger") in (None, True):
            checkpoint = self._get(self.config_init, "ckpt_path") if self.subcommand == "fit" else None
            resumed = resumed_run(read_checkpoint(checkpoint, mmap=True)) if checkpoint else None
            kwargs["logger"] = default_loggers(config.get("default_root_dir") or "out", resumed)
            callbacks.append(LoggerIds())
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            # a log file (nohup, SLURM) gets plain lines as the fit goes; Rich's bar would show only at the end
            callbacks.append(SentEmbProgressBar(SELECTION_METRIC) if sys.stdout.isatty()
                             else PlainProgress(monitor=SELECTION_METRIC))
        if config.get("enable_model_summary") is not False and not any(isinstance(c, ModelSummary) for c in callbacks):
            callbacks.append(SentEmbModelSummary())
        kwargs["callbacks"] = callbacks
        plugins = config.get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        if not any(isinstance(plugin, CheckpointIO) for plugin in plugins):
            kwargs["plugins"] = [*plugins, AtomicCheckpointIO()]
        trainer = super().instantiate_trainer(**kwargs)
        if self.subcommand == "fit" and (
                notice := slow_bf16_notice(str(trainer.precision), trainer.strategy.root_device.type)):
            rank_zero_info(notice)
        return trainer

    def _resolve_last(self) -> None:
        """`--ckpt_path last` (`resolve_last`)."""
        config = self.config_init[self.subcommand]
        if config.get("ckpt_path") == "last":
            config["ckpt_path"] = resolve_last(self.subcommand, self.run_checkpoint, decided_by_rank_zero)

    def _refuse_stale_checkpoints(self) -> None:
        """A new fit never leaves an earlier run's checkpoints looking like its own."""
        config = self.config_init[self.subcommand]
        if config.get("ckpt_path") is not None:
            return
        folder = Path(self.run_checkpoint.dirpath)
        stale = sorted(folder.glob("*.ckpt"))
        if not stale:
            return
        if not config.get("overwrite"):
            raise SentEmbUserError(
                f"{folder} holds checkpoints of an earlier run ({', '.join(p.name for p in stale)}): resume it with "
                "--ckpt_path last, or choose another --trainer.default_root_dir, "
                "or pass --overwrite true to delete them"
            )
        if self.trainer.is_global_zero:
            for path in stale:
                path.unlink(missing_ok=True)
            rank_zero_info(f"--overwrite: deleted {len(stale)} checkpoint(s) of an earlier run in {folder}")

    def before_fit(self) -> None:
        self._refuse_stale_checkpoints()

    def _resolve_best(self) -> None:
        """`--ckpt_path best`: the best checkpoint of the run's `checkpoint` callback (in a fresh
        process, the `best.ckpt` of an earlier `fit`), named by its path so that another
        ModelCheckpoint (a preset's) is never taken for it."""
        config = self.config_init[self.subcommand]
        if config.get("ckpt_path") != "best":
            return
        callback = self.run_checkpoint
        best = Path(callback.best_model_path or Path(callback.dirpath) / "best.ckpt")
        if not best.exists():
            raise SentEmbUserError(f"--ckpt_path best: {best} does not exist; run `sentemb fit` with this config first")
        config["ckpt_path"] = str(best)

    def before_test(self) -> None:
        """The method prints the STS table once; Lightning's per-DataLoader tables would repeat its numbers."""
        self._resolve_best()
        self.config_init[self.subcommand]["verbose"] = False

    def before_validate(self) -> None:
        self._resolve_best()


def resolve_last(subcommand: str, callback: SentEmbCheckpoint, agree: Callable[[str], str]) -> str | None:
    """`--ckpt_path last`: `<default_root_dir>/checkpoints/last.ckpt`. A fit with no checkpoint at all there
    starts from step 0 (so a requeued job can always pass it). Rank 0 looks and the ranks take its answer
    (`agree`: `distributed.decided_by_rank_zero`): on a shared filesystem they can see different files, and
    ranks that resumed beside ranks that started afresh would wait for each other forever."""
    last = callback.last_path
    if last.exists():
        seen = "last"
    elif subcommand == "fit" and not list(Path(callback.dirpath).glob("*.ckpt")):
        seen = "none"
    else:
        seen = "missing"
    seen = agree(seen)
    if seen == "last":
        return str(last)
    if seen == "none":
        rank_zero_info(f"--ckpt_path last: no checkpoint in {callback.dirpath} yet, starting from step 0")
        return None
    raise SentEmbUserError(f"--ckpt_path last: {last} does not exist; run `sentemb fit` with this config "
                           "(and --trainer.default_root_dir) first")


def lightning_main(args: list[str] | None, callbacks: Sequence[Callback] = ()) -> SentEmbCLI:
    """Run a LightningCLI subcommand; `callbacks` join the config's (`sentemb sweep` tracks its metric so).

    A fit stopped by SIGTERM or Ctrl-C (after saving last.ckpt) exits with status 143, not 0.
    """
    silence_known_noise()
    add_user_folders(config_files_in(sys.argv[1:] if args is None else args))  # a class_path beside the config
    torch.serialization.add_safe_globals(SAFE_GLOBALS)  # `--ckpt_path` loads with weights_only=True as well
    try:
        return SentEmbCLI(
            SentEmbMethod,
            SentEmbDataModule,
            subclass_mode_model=True,
            parser_class=SentEmbArgumentParser,
            parser_kwargs={"parser_mode": "omegaconf", "prog": "sentemb", "allow_abbrev": False},  # no silent prefixes
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


def end_of_fit(cli: SentEmbCLI) -> None:
    """The last lines of `sentemb fit`: where the results are and what to run next."""
    if cli.trainer.is_global_zero:
        print(fit_summary(cli.trainer, cli.run_checkpoint), flush=True)


def keep_best_only(cli: SentEmbCLI) -> None:
    """A finished run of a sweep or of reproduce is never resumed: its `last.ckpt` (the full state, three
    times a lean `best.ckpt` under AdamW) is deleted, `best.ckpt` kept."""
    if cli.trainer.is_global_zero:
        cli.run_checkpoint.last_path.unlink(missing_ok=True)
