"""gpu-check's bf16 part: every training path of `gpu_check_paths.PATHS` trained for 4 steps in
`Trainer.fit` (bf16-mixed, fused AdamW, the method's own hooks and callbacks), as `sentemb fit` trains it:
`training_step` (its `step_loss`, the MLM loss included, or gradient caching with manual optimization) and
its `self.log` calls. The last two steps run under CUDA's sync debug mode (`SyncRecorder`), each from its
`on_train_batch_start`, after Lightning moved the batch to the device, to the end of its last
`on_train_batch_end` (ClusterNS's centroid update included): the third under "warn", which lists every
host sync with its line, the fourth under "error", which raises at the first (the verdict, even where
code silences warnings). The first two create Lightning's logged metrics (their first values are copied
from the host) and start clustering (σ 1: its check reads the host until it starts), which a fit does
once, not every step.

Each row checks: loss and trainable weights finite, weights updated, the logs its options must write
(`mlm_loss`, the guide's masked fraction), clustering running in the last step, and (CUDA) no host
sync in the last two; it names the packed-attention kernels that ran and the peak memory.
"""

from __future__ import annotations

import math
import tempfile
import time
import traceback
from typing import Any

from gpu_check_common import Context, kernels_text, one_line, outcome, trainer_options, training_examples
from gpu_check_paths import PATHS, TrainingPath, resolve
from gpu_check_sync import SyncRecorder, raised_sync

SYNCS, VERDICT = "host syncs, step 3 (warn)", "sync, step 4 (error)"


def sync_windows(recorders: dict[int, SyncRecorder]) -> tuple[Any, Any]:
    """Two callbacks that start `recorders[i]` at batch i's `on_train_batch_start` (the first callback)
    and stop it after its last `on_train_batch_end` (the closer moves itself after the method's own
    callbacks in `setup`, when Lightning has attached them). The opener also keeps each trainable tensor as
    training starts and whether clustering had started before the last step."""
    from lightning.pytorch import Callback

    class Opener(Callback):
        def __init__(self) -> None:
            self.initial: list = []
            self.clustering: bool | None = None

        def on_train_start(self, trainer, pl_module) -> None:
            self.initial = [p.detach().clone() for p in pl_module.parameters() if p.requires_grad]

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == max(recorders):
                state = getattr(pl_module, "cluster_state", None)
                self.clustering = None if state is None else state.is_initialized  # a host flag
            if batch_idx in recorders:
                recorders[batch_idx].start()

    class Closer(Callback):
        def setup(self, trainer, pl_module, stage) -> None:
            trainer.callbacks.remove(self)
            trainer.callbacks.append(self)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx in recorders:
                recorders[batch_idx].stop()

        def on_exception(self, trainer, pl_module, exception) -> None:
            for recorder in recorders.values():
                recorder.stop()

    return Opener(), Closer()


def option_checks(path: TrainingPath, method: Any, logged: dict[str, float], clustering: bool | None) -> list[str]:
    """What the row's options must have done, as failure notes."""
    notes = []
    if path.kwargs.get("mlm_weight") and "train/mlm_loss" not in logged:
        notes.append("no MLM loss logged")
    if path.kwargs.get("guide") and "train/guide/masked_fraction" not in logged:
        notes.append("the guide logged no masked fraction")
    if hasattr(method, "cluster_state") and not clustering:
        notes.append("clustering had not started before the last step")
    return notes


def train_path(ctx: Context, path: TrainingPath, values: dict[str, Any]) -> dict[str, Any]:
    """`path_steps` steps of one path in `Trainer.fit` (4; 2 in --smoke), the last two under sync debug; the
    row."""
    import torch
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    from lightning_sentemb.encoders.kernels import kernels_ran, reset_kernels_ran

    cuda = ctx.device.type == "cuda"
    torch.manual_seed(0)
    folder = ctx.bert if path.model == "bert" else ctx.decoder
    method = path.method(folder, **resolve(path.kwargs, values))  # weights load in fit, on the device
    batch, steps = ctx.sizes.path_batch, ctx.sizes.path_steps
    examples = training_examples(method, ctx.sentences, (steps + 1) * batch, path.batch)
    loader = DataLoader(examples, batch_size=batch, collate_fn=method.collator, drop_last=True, pin_memory=cuda)
    recorder, verdict = SyncRecorder(cuda, "warn"), SyncRecorder(cuda, "error")
    opener, closer = sync_windows({steps - 2: recorder, steps - 1: verdict})
    reset_kernels_ran()
    if cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    raised = None
    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(devices=1, callbacks=[opener, closer], **trainer_options(ctx, root, steps))
        try:
            trainer.fit(method, loader)
        except RuntimeError as error:
            raised = raised_sync(error)
            if raised is None:
                raise
            traceback.print_exc()  # into the part's log: the whole stack of the sync
        finally:
            recorder.stop()
            verdict.stop()
    row: dict[str, Any] = {"kernels": kernels_text(kernels_ran())}
    if cuda:
        row["peak MiB"] = torch.cuda.max_memory_allocated(ctx.device) / 2**20
    logged = {key: float(value) for key, value in trainer.callback_metrics.items()}
    loss = logged.get("train/loss", math.nan)
    trainable = [p.detach() for p in method.parameters() if p.requires_grad]  # on the CPU: Lightning's teardown
    moved = sum(not torch.equal(before.to(after.device), after)
                for before, after in zip(opener.initial, trainable, strict=True))
    notes = option_checks(path, method, logged, opener.clustering)
    if not math.isfinite(loss):
        notes.append("non-finite loss")
    if not all(bool(torch.isfinite(p).all()) for p in trainable):
        notes.append("non-finite weights")
    if not moved:
        notes.append("no trainable tensor changed")
    if recorder.syncs:
        notes.append(f"{len(recorder.syncs)} host sync(s) in step 3")
    if raised is not None:
        notes.append("a host sync in step 4")
    row.update({"loss": loss, "logged": ", ".join(f"{k.removeprefix('train/')} {v:.4g}" for k, v in logged.items()
                                                  if k != "train/loss") or "-",
                "trainable tensors updated": f"{moved} of {len(trainable)}",
                SYNCS: recorder.summary() if cuda else "not checked (CPU)",
                VERDICT: str(raised or "none") if cuda else "not checked (CPU)",
                "result": f"fail: {'; '.join(notes)}" if notes else "pass" if cuda else "pass (CPU: no sync debug)"})
    return row


def recorder_control(ctx: Context) -> dict[str, Any]:
    """Both modes must catch a deliberate host sync (`.item()`), or the sync columns prove nothing."""
    import torch

    row: dict[str, Any] = {"model": "-", "path": "control: a deliberate .item() under both modes"}
    if ctx.device.type != "cuda":
        return {**row, "result": "skipped: the CPU has no sync debug mode"}
    recorder, verdict, raised = SyncRecorder(cuda=True, mode="warn"), SyncRecorder(cuda=True, mode="error"), None
    for mode in (recorder, verdict):
        mode.start()
        try:
            torch.ones(1, device=ctx.device).sum().item()
        except RuntimeError as error:
            raised = raised_sync(error)
            if raised is None:
                raise
        finally:
            mode.stop()
    seen = bool(recorder.syncs) and raised is not None
    return {**row, SYNCS: recorder.summary(), VERDICT: str(raised),
            "result": "pass" if seen else "fail: a mode missed the sync: the sync columns prove nothing"}


def bf16_steps(ctx: Context) -> dict:
    """Every training path (`PATHS`) in `Trainer.fit`, bf16-mixed; the recorder's control first."""
    from lightning_sentemb.backbones import UnsupportedBackbone

    ctx.need_models()
    values = {"bert": ctx.bert, "chunk": ctx.sizes.chunk, "clusters": min(16, ctx.sizes.path_batch),
              "lora": ctx.lora(dropout=0.05)}
    rows = [recorder_control(ctx)]
    for path in PATHS:
        row: dict[str, Any] = {"model": "bert-base" if path.model == "bert" else "Qwen2-0.5B-shaped",
                               "path": path.name}
        start = time.perf_counter()
        try:
            row.update(train_path(ctx, path, values))
        except UnsupportedBackbone as refusal:
            row["result"] = f"skipped: {one_line(refusal)}"
        except Exception as error:  # one path failing must not hide the others
            traceback.print_exc()  # into the part's log
            row["result"] = f"fail: {one_line(error)}"
        ctx.free()
        rows.append({**row, "seconds": time.perf_counter() - start})
        ctx.keep_rows(rows)
    return outcome(rows)
