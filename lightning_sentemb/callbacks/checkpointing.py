"""What makes every fit leave a usable, resumable result.

- `SentEmbCheckpoint`: `best.ckpt` (best by STS-B dev, Lightning's `ModelCheckpoint`; lean: no
  optimizer state, what evaluation, test and export read) and `last.ckpt`
  (the latest state: every validation, every `every_n_train_steps` steps, the end of fit, and an
  interruption by SIGTERM, SLURM's pre-emption signal or Ctrl-C), plus a validation after the last
  step when that step was not a validation step.
- `AtomicCheckpointIO`: checkpoint files written beside the target and renamed, never half-written.
- `TrainingGuard`: a non-finite loss stops the run before anything of it is saved; a collapsed model
  (in-batch loss at ln(candidates) and STS-B dev not above its start) gets a logged warning.

Neither makes a training step wait for the GPU: the loss is checked on the device, and the guard's
verdict and the stop signal are read (and agreed between DDP ranks) only every `log_every_n_steps`
steps, at validation and before a checkpoint is written.

Exact resume also needs the data order and the per-step randomness: `SentEmbDataModule` (resumable
sampler, per-batch seeds for `collate`) and `SentEmbMethod.on_train_batch_start` (per-step RNG seeds).
"""

from __future__ import annotations

import math
import signal
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor
from torch.distributed.tensor import DTensor

from ..atomic_io import atomic_write
from ..distributed import at_decision_step
from ..errors import SentEmbUserError

__all__ = ["AtomicCheckpointIO", "GuardedCheckpoint", "SentEmbCheckpoint", "TrainingGuard", "LAST_NAME"]

LAST_NAME = "last"


# What only a resume reads: the optimizer's moments (twice the trainable weights under AdamW) and the
# schedule. A lean checkpoint (best.ckpt) leaves them out; evaluation, export and test need neither.
RESUME_ONLY = ("optimizer_states", "lr_schedulers")


class AtomicCheckpointIO(TorchCheckpointIO):
    """`torch.save` into a temporary file beside the target, then one rename: a kill at any moment
    leaves the previous checkpoint or none (Lightning's own writer stages in `$TMPDIR`, which may be
    another filesystem, where the final move is a copy that a kill can cut short). Inside `lean()`,
    what only a resume needs (`RESUME_ONLY`) is left out."""

    def __init__(self) -> None:
        super().__init__()
        self._left_out: tuple[str, ...] = ()

    @contextmanager
    def lean(self) -> Iterator[None]:
        self._left_out = RESUME_ONLY
        try:
            yield
        finally:
            self._left_out = ()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options; got {storage_options!r}")
        kept = {key: value for key, value in checkpoint.items() if key not in self._left_out}
        atomic_write(path, lambda file: torch.save(kept, file))


def _finite_weights(trainer: Trainer) -> bool:
    """Every parameter finite on every rank, read back once (not once per tensor). Under FSDP each rank
    holds a shard (a DTensor's local part): the ranks decide together (one all-reduce), so all save or
    none does (a rank that skipped would leave the others waiting in the checkpoint's collectives)."""
    shards = [p.to_local() if isinstance(p, DTensor) else p for p in trainer.lightning_module.parameters()]
    finite = bool(torch.stack([torch.isfinite(p).all() for p in shards if p.numel()] or [torch.tensor(True)]).all())
    return trainer.strategy.reduce_boolean_decision(finite, all=True)


class GuardedCheckpoint(ModelCheckpoint):
    """A `ModelCheckpoint` whose every write asks the `TrainingGuard` first (it raises on a non-finite
    loss since its last decision) and skips non-finite weights: no checkpoint, ours or a preset's,
    holds a state from a non-finite step on."""

    def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        check_guards(trainer)
        if not _finite_weights(trainer):
            rank_zero_warn(f"{filepath} not written at step {trainer.global_step}: the weights are not finite")
            return
        super()._save_checkpoint(trainer, filepath)


class SentEmbCheckpoint(GuardedCheckpoint):
    """`best.ckpt` by `monitor` at each validation, and `last.ckpt`, the latest state.

    `last.ckpt` is written at every validation, every `every_n_train_steps` optimizer steps, at the
    end of fit, and when the run is interrupted: SIGTERM (SLURM pre-emption, `scancel`, a time
    limit with `--signal=TERM@120`) and Ctrl-C stop every rank after the running step and save
    `last.ckpt` (`sentemb` then exits with status 143). A second Ctrl-C aborts at once without
    saving. Always at a step boundary and never with non-finite weights or after a non-finite loss
    (every write asks the `TrainingGuard` first), so `--ckpt_path last` resumes exactly.

    The stop takes effect after the step the signal arrives in when training runs in one process.
    Under DDP all ranks must stop after the same step, and agreeing costs a collective, so the
    ranks compare their flags only every `log_every_n_steps` steps and where `last.ckpt` is written
    anyway (every `every_n_train_steps` steps, after each validation): a signal stops the run up to
    `log_every_n_steps - 1` steps after it arrives (10 by default; keep SLURM's
    `--signal=TERM@<seconds>` above that many steps).

    When the last step of a fit is not a validation step, validation runs after it, so every fit
    reports STS-B dev and selects `best.ckpt` among all validated states.

    Args:
        every_n_train_steps: also write `last.ckpt` every N steps (None: only at the events above).
            Unlike `ModelCheckpoint`'s, it does not move the `best.ckpt` selection off validation.
        Others: see `ModelCheckpoint` (`best.ckpt` is its `filename`; top-1, no version suffix).
    """

    def __init__(
        self,
        dirpath: str | None = None,
        filename: str = "best",
        monitor: str | None = None,
        mode: str = "max",
        every_n_train_steps: int | None = None,
        verbose: bool = False,
    ) -> None:
        super().__init__(dirpath=dirpath, filename=filename, monitor=monitor, mode=mode, save_top_k=1,
                         enable_version_counter=False, verbose=verbose)
        if every_n_train_steps is not None and every_n_train_steps < 1:
            raise SentEmbUserError(f"--checkpoint.every_n_train_steps must be a positive number of steps or null; "
                                   f"got {every_n_train_steps}")
        self.last_every_n_train_steps = every_n_train_steps
        self._last_saved_step: int | None = None
        self._stop_requested = False
        self._previous_handlers: dict[int, Any] = {}

    @property
    def last_path(self) -> Path:
        return Path(self.dirpath) / f"{LAST_NAME}{self.FILE_EXTENSION}"

    def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        """`best.ckpt` lean: weights, hyper-parameters, step and this selection, without the optimizer
        state (a third of a full fine-tune's file); a resume reads `last.ckpt`."""
        checkpoint_io = trainer.strategy.checkpoint_io
        with checkpoint_io.lean() if isinstance(checkpoint_io, AtomicCheckpointIO) else nullcontext():
            super()._save_checkpoint(trainer, filepath)

    def write_last(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Write `last.ckpt` (once per step) unless the weights are not finite."""
        if trainer.sanity_checking or self._last_saved_step == trainer.global_step:
            return
        check_guards(trainer)
        if not _finite_weights(trainer):
            rank_zero_warn(f"last.ckpt not written at step {trainer.global_step}: the weights are not finite")
            return
        trainer.save_checkpoint(self.last_path, weights_only=False)  # full state: a resume needs it
        self._last_saved_step = trainer.global_step
        self.last_model_path = str(self.last_path)

    # ----- when last.ckpt is written ---------------------------------------------------------
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_saved_step = trainer.global_step  # nothing new to save before the first step
        self._install_stop_handlers()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._is_last_step(trainer):
            trainer.should_stop = True  # makes the epoch loop validate after this step
        n = self.last_every_n_train_steps
        writing = n is not None and trainer.global_step % n == 0
        if writing:
            self.write_last(trainer, pl_module)
        self._stop_if_agreed(trainer, pl_module, writing)

    def _stop_if_agreed(self, trainer: Trainer, pl_module: LightningModule, writing: bool) -> None:
        """Stop every rank here, `last.ckpt` saved, if a stop was asked. One process: its own flag,
        every step (a host bool, no sync). DDP: one decision for all ranks (a signal may reach only
        some), made by a collective only every `log_every_n_steps` steps and where `last.ckpt` is
        written anyway (`writing`: every `every_n_train_steps` steps, after each validation)."""
        if trainer.world_size == 1:
            stop = self._stop_requested
        elif not (writing or at_decision_step(trainer)):
            stop = False
        else:
            stop = trainer.strategy.reduce_boolean_decision(self._stop_requested, all=False)
        if stop:
            self.write_last(trainer, pl_module)
            rank_zero_info(f"stopped at step {trainer.global_step}: {self.last_path} saved; "
                           "resume with --ckpt_path last")
            raise SIGTERMException

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self.write_last(trainer, pl_module)
            self._stop_if_agreed(trainer, pl_module, writing=True)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.write_last(trainer, pl_module)
        self._restore_handlers()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """Anything but our own stop (a bug, a diverged loss, a second Ctrl-C) may come mid-step:
        nothing is saved then."""
        self._restore_handlers()

    @staticmethod
    def _is_last_step(trainer: Trainer) -> bool:
        if trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps:
            return True
        max_epochs = trainer.max_epochs
        last_epoch = max_epochs is not None and max_epochs != -1 and trainer.current_epoch + 1 >= max_epochs
        return last_epoch and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch

    # ----- SIGTERM and Ctrl-C: stop at the next step boundary -------------------------------
    def _install_stop_handlers(self) -> None:
        """While training, SIGTERM and the first Ctrl-C only ask for a stop (Lightning's own SIGTERM
        handler broadcasts from inside the handler, which can deadlock DDP ranks)."""
        self._stop_requested = False
        if threading.current_thread() is not threading.main_thread():
            return
        self._previous_handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}

        def request_stop(signum: int, frame: Any) -> None:
            if signum == signal.SIGINT and self._stop_requested:
                raise KeyboardInterrupt  # a second Ctrl-C: abort now, nothing saved
            self._stop_requested = True
            rank_zero_info(f"{signal.Signals(signum).name}: stopping after this step and saving last.ckpt"
                           + (" (Ctrl-C again aborts without saving)" if signum == signal.SIGINT else ""))

        for signum in self._previous_handlers:
            signal.signal(signum, request_stop)

    def _restore_handlers(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for signum, handler in self._previous_handlers.items():
                signal.signal(signum, handler)
        self._previous_handlers = {}


def _step_loss(outputs: Any) -> torch.Tensor | None:
    """The loss `training_step` returned (a tensor, or a mapping with "loss"), automatic or manual
    optimization alike."""
    if isinstance(outputs, Mapping):
        outputs = outputs.get("loss")
    return outputs if isinstance(outputs, torch.Tensor) else None


def check_guards(trainer: Trainer) -> None:
    """Let every `TrainingGuard` of the trainer decide (it raises on a non-finite loss): called
    before any checkpoint is written."""
    for callback in trainer.callbacks:
        if isinstance(callback, TrainingGuard):
            callback.check(trainer)


class TrainingGuard(Callback):
    """Stops a diverged run and warns about a collapsed one.

    Divergence: the loss `training_step` returns (automatic and manual optimization alike) is
    checked on the device after every step, without reading it back: the first non-finite loss and
    its step stay on the device. They are read back only where a decision needs them (`check`):
    every `log_every_n_steps` steps, at the start of each validation, before any checkpoint is
    written (`SentEmbCheckpoint` asks), and at the end of fit. A non-finite loss then raises one
    `SentEmbUserError` naming the loss, the step it happened at, the learning rate and the
    precision. The run stops at that decision point, which may be up to `log_every_n_steps - 1`
    steps later (the line says at which step it was seen); no checkpoint holds any state from the
    non-finite step on. Under DDP the ranks decide together (one all-reduce per decision), so a
    rank never stops alone and leaves the others waiting in a collective.

    Collapse (every sentence mapped to the same vector) shows as an in-batch softmax loss at
    ln(candidates), candidates = global batch × (views − 1); at each validation, a warning is
    logged when the last training loss is within `collapse_tolerance` of it and `monitor` is not
    above the first validation of the run.
    """

    def __init__(self, monitor: str, collapse_tolerance: float = 0.02) -> None:
        self.monitor = monitor
        self.collapse_tolerance = collapse_tolerance
        self.last_loss: Tensor | None = None
        self.collapse_loss: float | None = None
        self.start_score: float | None = None
        self._bad_step: Tensor | None = None  # step of the first non-finite loss, -1 while there is none
        self._bad_loss: Tensor | None = None
        self._unchecked = False  # steps ran since the last check

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = _step_loss(outputs)
        if loss is None:
            return
        loss = loss.detach().float()
        if self._bad_step is None:
            self._bad_step = torch.full((), -1, dtype=torch.long, device=loss.device)
            self._bad_loss = torch.zeros((), device=loss.device)
        first = ~torch.isfinite(loss) & (self._bad_step < 0)
        self._bad_step = torch.where(first, trainer.global_step, self._bad_step)  # Python scalars: no copy
        self._bad_loss = torch.where(first, loss, self._bad_loss)
        self._unchecked = True
        self.last_loss = loss
        if isinstance(batch, Mapping) and "num_views" in batch:
            size = batch.get("batch_size") or batch["features"]["input_ids"].size(0) // batch["num_views"]
            self.collapse_loss = math.log(size * trainer.world_size * max(batch["num_views"] - 1, 1))
        if at_decision_step(trainer):
            self.check(trainer)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.check(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.check(trainer)

    def check(self, trainer: Trainer) -> None:
        """Raise if any rank has seen a non-finite loss: one read-back (and one all-reduce under
        DDP); nothing when no step ran since the last check (the same on every rank)."""
        if not self._unchecked:
            return
        self._unchecked = False
        if not trainer.strategy.reduce_boolean_decision(bool(self._bad_step >= 0), all=False):
            return
        seen = trainer.strategy.all_gather(torch.stack([self._bad_step.double(), self._bad_loss.double()]))
        step, loss = min((row for row in seen.view(-1, 2).tolist() if row[0] >= 0), key=lambda row: row[0])
        lr = trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else float("nan")
        raise SentEmbUserError(
            f"training diverged: loss {loss} at step {int(step)} (seen at step {trainer.global_step}; no checkpoint "
            f"holds a later state than step {int(step) - 1}); lower --model.lr (now {lr:.3g}) or raise "
            f"--trainer.precision (now {trainer.precision}; 32 or bf16-mixed instead of 16-mixed), then resume "
            "with --ckpt_path last or start again"
        )

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        score = trainer.callback_metrics.get(self.monitor)
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING or score is None:
            return
        score = float(score)
        if self.start_score is None:
            self.start_score = score
        if self.last_loss is None or self.collapse_loss is None:
            return
        last_loss = float(self.last_loss)
        at_chance = abs(last_loss - self.collapse_loss) <= self.collapse_tolerance * self.collapse_loss
        if at_chance and score <= self.start_score:
            rank_zero_warn(
                f"the model looks collapsed at step {trainer.global_step}: training loss {last_loss:.4f} ≈ "
                f"ln(in-batch candidates) = {self.collapse_loss:.4f} and {self.monitor} {score:.2f} is not above its "
                f"start ({self.start_score:.2f}); lower --model.lr"
            )
