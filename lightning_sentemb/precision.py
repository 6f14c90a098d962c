"""Precision of float32 matrix products: exact where a product decides a loss, TF32 elsewhere; and the
autocast of evaluation (`eval_precision`, `autocast_for`), shared by `encode` and the exports' modules.

Autocast recasts every matmul to bf16/fp16, whatever its inputs' dtype, and TF32 keeps 10 mantissa
bits. Both are fine for the backbone's GEMMs, but not for the similarity logits: at τ 0.05 a cosine
rounded to bf16 (about ±4e-3) moves a logit by 0.08, and the nearest centroid or a false-negative
decision can flip on a near tie. `exact_fp32` is the one place that turns both off.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def exact_fp32(device_type: str) -> Iterator[None]:
    """Float32 matrix products computed in float32 inside the block: autocast off, TF32 off (the global
    matmul precision is set back on exit; host-side flags, no device sync). Inputs must be cast to
    float32 by the caller; the backward of these products runs later, under the caller's settings."""
    previous = torch.get_float32_matmul_precision()
    if previous != "highest":
        torch.set_float32_matmul_precision("highest")
    try:
        with torch.autocast(device_type, enabled=False):
            yield
    finally:
        if previous != "highest":
            torch.set_float32_matmul_precision(previous)


def autocast_for(device: torch.device, precision: str) -> torch.autocast:
    """`eval_precision`'s autocast: with "auto", bf16 on GPUs that support it (fp16 on older ones) and none
    on CPU; "bf16" everywhere; "32" none."""
    if device.type == "cuda" and precision == "auto":
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.autocast("cuda", dtype=dtype)
    enabled = precision == "bf16"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def use_tf32(enabled: bool) -> None:
    """TF32 for float32 matrix products on CUDA GPUs (Ampere and later: about 8x the fp32 throughput of the
    tensor cores, 10 mantissa bits) or not; the top-level `tf32` option of `sentemb fit` (default on).

    It matters where something runs in fp32: `trainer.precision: 32`, and the fp32 heads and optimizer of
    mixed precision (bf16 autocast already runs the backbone's products in bf16). Without CUDA nothing is
    changed: the same setting would also let oneDNN use TF32 on CPUs that have it. Set through
    `torch.set_float32_matmul_precision`, the setting Lightning reads (and warns about when left at "highest")."""
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high" if enabled else "highest")


def cpu_runs_bf16_slowly() -> bool:
    """True on a CPU without the instructions oneDNN needs for fast bf16 (AVX-512 BW/VL/DQ, AVX-512
    BF16 or AMX): there each bf16 product is converted and run in fp32 element by element, and a bf16
    training step of MiniLM took about 7x an fp32 one (an AVX2-only EPYC; docs/benchmarks.md)."""
    return not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def slow_bf16_notice(precision: str, device_type: str) -> str | None:
    """One line for a bf16 run on such a CPU (`precision` and `device_type` as the Trainer resolved them),
    or None: the fit is right, only slow, so it goes on and says how to make it fast."""
    if not (device_type == "cpu" and precision.startswith("bf16") and cpu_runs_bf16_slowly()):
        return None
    return (f"trainer.precision {precision} on a CPU without bf16 instructions (no AVX-512/AMX): each step "
            "runs several times slower than in fp32; pass --trainer.precision 32-true to train faster")
