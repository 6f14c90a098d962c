"""What a training step waits for, counted per step and attributed to the code that asked.

Host syncs: the Tensor methods that read a value back to the host (`item`, `__bool__`, `__float__`,
`__int__`, `__index__`, `tolist`, `numpy`, `cpu`, `to(cpu)`, `nonzero`) are wrapped, and a
`TorchDispatchMode` sees the operators that read back inside C++ without any of those methods
(boolean-mask indexing, `masked_select`, `nonzero`, `unique`, `repeat_interleave` without an output
size, `bincount`, `equal`, `_local_scalar_dense`). On a CPU machine no read actually waits, but each
counted call is one that stops the CPU from queueing work on a GPU. `cpu()` is counted on any
tensor (on a GPU it is a copy back); `to(cpu)` only from another device (on a CPU machine it cannot
be told from a move to the tensor's own device, which every batch transfer makes).

Collectives: the `torch.distributed` functions are wrapped, and DDP's gradient all-reduce (in C++)
is counted through a communication hook (`gradient_allreduce_hook`, registered at fit start).

Attribution: a read or collective made under `torch.utils.data` is the loader's (collate runs in
DataLoader workers on a GPU machine: host work, no sync); otherwise it belongs to the innermost
stack frame outside torch itself: `lightning_sentemb/<file>` for ours, else the third-party package
(`lightning`, `transformers`, ...). A read inside a backward pass belongs to the forward operation
it differentiates, not to whoever called `backward`: boolean-mask indexing (`x[mask]`,
`x[mask] = v`), whose backward reads again, remembers where it ran; any other backward read is
owned by "autograd".
Each record carries the training step it happened in (batches started, 1-based) or the phase
outside steps (validation).

Used by tests/test_sync_free.py and benchmarks/data.py.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_sentemb

PACKAGE = Path(lightning_sentemb.__file__).resolve().parent
TORCH = str(Path(torch.__file__).resolve().parent) + "/"
LOADER = TORCH + "utils/data/"
AUTOGRAD_GATHER = TORCH + "distributed/nn/functional.py"  # what distributed.gather_with_grad calls
GATHER_OWNER = "lightning_sentemb/distributed.py"
REPO = PACKAGE.parent

READ_METHODS = ("item", "__bool__", "__float__", "__int__", "__index__", "tolist", "numpy", "cpu", "to", "nonzero")
aten = torch.ops.aten
READING_OPS = {
    aten.nonzero: "nonzero", aten.masked_select: "masked_select", aten._unique: "unique", aten._unique2: "unique",
    aten.unique_dim: "unique", aten.unique_consecutive: "unique", aten.bincount: "bincount", aten.equal: "equal",
    aten._local_scalar_dense: "item",
}
INDEXING_OPS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
BOOLEAN = (torch.bool, torch.uint8)
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all", "all_to_all_single",
               "reduce_scatter", "reduce_scatter_tensor", "broadcast", "reduce", "barrier", "all_gather_object",
               "broadcast_object_list", "gather", "scatter", "_broadcast_coalesced")


@dataclass(frozen=True)
class Record:
    step: int | str  # the training step (1-based), or "validation"
    owner: str  # "lightning_sentemb/<file>", "lightning", "transformers", ..., "loader"
    where: str  # file:line function of the innermost frame outside torch
    what: str  # the method, operator or collective


Frame = tuple[str, int, str]  # file, line, function


def python_stack(frame: Any) -> list[Frame]:
    """The stack from `frame` outward (innermost first)."""
    frames = []
    while frame is not None:
        frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return frames


def owner_of(stack: list[Frame]) -> tuple[str, str]:
    """(owner, where) of a call, from its stack, innermost first (see the module docstring)."""
    files = [name for name, _, _ in stack]
    if any(name.startswith(LOADER) for name in files):
        return "loader", ""
    if AUTOGRAD_GATHER in files:  # forward and backward (the autograd engine runs the latter)
        return GATHER_OWNER, "gather_with_grad (autograd all-gather)"
    for name, line, function in stack:
        if name.startswith(TORCH) or name == __file__:
            continue
        where = f"{Path(name).name}:{line} {function}"
        path = Path(name).resolve()
        if path.is_relative_to(PACKAGE):
            return f"lightning_sentemb/{path.relative_to(PACKAGE)}", where
        ours = next((f"{Path(n).name}:{ln} {fn}" for n, ln, fn in stack if Path(n).resolve().is_relative_to(PACKAGE)
                     and Path(n).name not in ("cli.py", "lightning_cli.py")), None)
        where += f" (from {ours})" if ours else ""
        if "site-packages" in path.parts:
            top = path.parts[path.parts.index("site-packages") + 1].split(".")[0]
            return {"pytorch_lightning": "lightning", "lightning_fabric": "lightning"}.get(top, top), where
        if path.is_relative_to(REPO):
            return path.relative_to(REPO).parts[0], where
        return path.stem, where
    return "unknown", ""


class StepCounter(Callback):
    """Records reads or collectives during training, each with its step; put it in the trainer's
    callbacks and run the fit inside `counting()`."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.trainer: Trainer | None = None
        self._inside = threading.local()
        self._forward_owners: dict[int, tuple[str, str]] = {}  # id(autograd node): (owner, where) of its forward

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.trainer = trainer

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._forward_owners.clear()  # the previous step's graph is gone

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if isinstance(trainer.strategy.model, DistributedDataParallel):
            trainer.strategy.model.register_comm_hook(None, self.gradient_allreduce_hook)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.trainer = None

    def record(self, what: str) -> None:
        trainer = self.trainer
        if trainer is None or getattr(self._inside, "depth", 0):
            return
        if trainer.sanity_checking or trainer.validating:
            step: int | str = "validation"
        else:
            step = trainer.fit_loop.epoch_loop.batch_progress.total.ready
        owner, where = owner_of(python_stack(sys._getframe(1)))
        node = torch._C._current_autograd_node()
        if node is not None and owner != GATHER_OWNER:  # a backward operation: attributed to its forward
            owner, where = self._forward_owners.get(id(node), ("autograd", node.name()))
            what += " (backward)"
        self.records.append(Record(step, owner, where, what))

    @contextmanager
    def _nested(self) -> Iterator[None]:
        """Calls made while one is being recorded (a method calling another, the operator under a
        method) are the same read."""
        self._inside.depth = getattr(self._inside, "depth", 0) + 1
        try:
            yield
        finally:
            self._inside.depth -= 1

    # ----- host syncs ----------------------------------------------------------------------
    @contextmanager
    def counting_host_syncs(self) -> Iterator[None]:
        originals = {name: getattr(torch.Tensor, name) for name in READ_METHODS}

        def wrap(name: str, original: Any) -> Any:
            def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if name != "to" or _copies_to_host(tensor, args, kwargs):
                    self.record(name if name != "to" else "to(cpu)")
                with self._nested():
                    return original(tensor, *args, **kwargs)

            return read

        def remember_boolean_index(name: str, original: Any) -> Any:
            def index(tensor: torch.Tensor, key: Any, *value: Any) -> Any:
                result = original(tensor, key, *value)
                node = (tensor if name == "__setitem__" else result).grad_fn
                keys = key if isinstance(key, tuple) else (key,)
                if node is not None and any(isinstance(k, torch.Tensor) and k.dtype in BOOLEAN for k in keys):
                    self._forward_owners[id(node)] = owner_of(python_stack(sys._getframe(1)))
                return result

            return index

        indexing = {name: getattr(torch.Tensor, name) for name in ("__getitem__", "__setitem__")}
        for name, original in originals.items():
            setattr(torch.Tensor, name, wrap(name, original))
        for name, original in indexing.items():
            setattr(torch.Tensor, name, remember_boolean_index(name, original))
        try:
            with _ReadingOps(self):
                yield
        finally:
            for name, original in {**originals, **indexing}.items():
                setattr(torch.Tensor, name, original)

    # ----- collectives ---------------------------------------------------------------------
    @contextmanager
    def counting_collectives(self) -> Iterator[None]:
        originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

        def wrap(name: str, original: Any) -> Any:
            def collective(*args: Any, **kwargs: Any) -> Any:
                self.record(name)
                with self._nested():
                    return original(*args, **kwargs)

            return collective

        for name, original in originals.items():
            setattr(dist, name, wrap(name, original))
        try:
            yield
        finally:
            for name, original in originals.items():
                setattr(dist, name, original)

    def gradient_allreduce_hook(self, state, bucket):  # no annotations: DDP checks them, and they are strings here
        """DDP's default all-reduce of a gradient bucket, counted (a DDP communication hook)."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        if self.trainer is not None:
            step = self.trainer.fit_loop.epoch_loop.batch_progress.total.ready
            self.records.append(Record(step, "DDP", "reducer", "gradient all_reduce"))
        with self._nested():  # its dist.all_reduce is this one
            return allreduce_hook(state, bucket)

    # ----- reading the records ---------------------------------------------------------------
    def per_step(self, owner_prefix: str = "") -> dict[int | str, Counter]:
        """{step: Counter of (owner, what)} of the records whose owner starts with `owner_prefix`."""
        steps: dict[int | str, Counter] = {}
        for r in self.records:
            if r.owner.startswith(owner_prefix):
                steps.setdefault(r.step, Counter())[(r.owner, r.what)] += 1
        return steps

    def table(self) -> str:
        """One line per (step, owner, where, what) with its count."""
        counts = Counter(self.records)
        ordered = sorted(counts.items(), key=lambda item: (str(item[0].step).zfill(10), item[0].owner))
        return "\n".join(f"{r.step!s:>10}  {r.owner:<42} {r.what:<20} x{n}  {r.where}" for r, n in ordered)


def _copies_to_host(tensor: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """`to` copies a device tensor to the CPU (on a CPU machine it never does: `to(cpu)` of a CPU
    tensor cannot be told from a move to the tensor's own device, as every batch transfer is)."""
    device = torch._C._nn._parse_to(*args, **kwargs)[0]
    return device is not None and device.type == "cpu" and tensor.device.type != "cpu"


class _ReadingOps(TorchDispatchMode):
    """Records the operators that read a device value back inside C++ (see the module docstring)."""

    def __init__(self, counter: StepCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in READING_OPS:
            self.counter.record(READING_OPS[packet])
        elif packet in INDEXING_OPS and any(
            isinstance(i, torch.Tensor) and i.dtype in BOOLEAN for i in args[1] or ()
        ):
            self.counter.record("boolean index")
        elif (func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor)
              and not kwargs.get("output_size")):
            self.counter.record("repeat_interleave")
        return func(*args, **kwargs)
