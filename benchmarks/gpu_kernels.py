"""gpu-check's first part: every packed-attention kernel (`lightning_sentemb.encoders.kernels`) forced on
bf16 packed rows of 1 to 128 tokens, forward and backward, against fp32 SDPA run sentence by sentence.

A kernel this device or torch cannot run is a skipped row with the reason (`unavailable`). The relative
error is ‖kernel − reference‖ / ‖reference‖, of the output and of the gradients of query, key, value
(and the prefix) under a fixed random cotangent; bf16 keeps 8 significant bits, so `TOLERANCE` is a few
times its unit roundoff, while a wrong mask, offset or head grouping makes errors of order 1.

The cases with attention dropout (BERT-family training; `varlen` then calls the flash op itself) check
what dropout must do: one draw differs from the reference (`DROPPED`: dropout was applied), the same
seed draws the same output, and the mean of `DRAWS` draws (output and gradients) is the reference
within `dropout_tolerance` (inverted dropout is unbiased; the mean's noise is about
sqrt(p / (1 - p) / draws) of the reference, 0.021 at p 0.1 over 256 draws, where dropout without its
1 / (1 - p) scaling would be 0.1 off).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from lightning_sentemb.encoders.kernels import KERNEL_NAMES, Packing, TorchFeatures, run_kernel, torch_features
from lightning_sentemb.encoders.layout import TokenLayout

TOLERANCE = 3e-2
DRAWS, SMOKE_DRAWS = 256, 16
DROPPED = 2e-2
# name: (query heads, key/value heads, causal, sliding window, prefix length, attention dropout)
CASES: dict[str, tuple[int, int, bool, int | None, int, float]] = {
    "bidirectional": (4, 4, False, None, 0, 0.0),
    "causal": (4, 4, True, None, 0, 0.0),
    "causal + window 16": (4, 4, True, 16, 0, 0.0),
    "GQA 14/2, causal": (14, 2, True, None, 0, 0.0),
    "prefix 4, bidirectional": (4, 4, False, None, 4, 0.0),
    "bidirectional, dropout 0.1": (4, 4, False, None, 0, 0.1),
    "GQA 14/2, causal, dropout 0.1": (14, 2, True, None, 0, 0.1),
}
LENGTHS = [1, 2, 3, 7, 16, 31, 64, 100, 128]
SMOKE_LENGTHS = [1, 2, 5, 9, 16]


def unavailable(kernel: str, features: TorchFeatures, device: torch.device, causal: bool, window: int | None,
                prefix: bool, dropout: float = 0.0) -> str | None:
    """Why `kernel` cannot run this case on this device and torch (bf16 inputs), or None."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if kernel == "varlen":
        if dropout and not features.flash_dropout:
            return f"torch {torch.__version__} has no aten._flash_attention_forward"
        if not dropout and not features.varlen:
            return f"torch {torch.__version__} has no usable torch.nn.attention.varlen.varlen_attn"
        if capability is None or capability < (8, 0):
            return "flash needs a CUDA GPU of sm80 or newer"
        if window and not features.varlen_window:
            return f"varlen_attn of torch {torch.__version__} takes no window_size"
        if prefix and causal:
            return "a prefix on a causal layer: keys longer than queries (auto runs aligned)"
    if kernel == "nested":
        if not features.nested:
            return f"torch {torch.__version__} has no nested jagged tensors with max_seqlen"
        if window:
            return "nested tensors take no sliding window"
        if capability is None and causal:
            return "causal attention on nested tensors needs CUDA (the CPU math kernel is bidirectional only)"
        if capability is not None and capability < (8, 0):
            return "bf16 needs sm80 or newer"
    return None


def reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: list[int], causal: bool,
              window: int | None, prefix: tuple[torch.Tensor, torch.Tensor] | None, scale: float) -> torch.Tensor:
    """fp32 SDPA sentence by sentence: key/value heads repeated per query group, the prefix's keys
    before each sentence's and visible to every query; (tokens, heads, d)."""
    groups = query.shape[1] // key.shape[1]
    outs, start = [], 0
    for row, length in enumerate(lengths):
        q, k, v = (t[start:start + length].transpose(0, 1).float() for t in (query, key, value))
        distance = torch.arange(length, device=q.device)[:, None] - torch.arange(length, device=q.device)[None]
        allowed = distance >= 0 if causal else torch.ones_like(distance, dtype=torch.bool)
        if window:
            allowed &= distance.abs() < window
        if prefix is not None:
            k = torch.cat([prefix[0][row].float(), k], dim=1)
            v = torch.cat([prefix[1][row].float(), v], dim=1)
            allowed = torch.cat([allowed.new_ones(length, prefix[0].shape[2]), allowed], dim=1)
        k, v = (t.repeat_interleave(groups, 0) for t in (k, v))
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale).transpose(0, 1))
        start += length
    return torch.cat(outs)


def dropout_tolerance(dropout: float, draws: int) -> float:
    """`TOLERANCE` plus three times the relative noise of a mean over `draws` dropout draws."""
    return TOLERANCE + 3 * math.sqrt(dropout / (1 - dropout) / draws)


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours.float() - theirs).norm() / theirs.norm().clamp_min(1e-12))


def check(kernel: str, case: str, device: torch.device, lengths: list[int], head_dim: int,
          draws: int = DRAWS) -> dict[str, Any]:
    """One kernel on one case: forward and backward errors against `reference` (with dropout: of the mean
    of `draws` draws)."""
    heads, kv_heads, causal, window, prefix_len, dropout = CASES[case]
    row: dict[str, Any] = {"kernel": kernel, "case": case}
    reason = unavailable(kernel, torch_features(), device, causal, window, prefix_len > 0, dropout)
    if reason is not None:
        return {**row, "result": f"skipped: {reason}"}
    generator = torch.Generator(device="cpu").manual_seed(0)
    tokens, batch = sum(lengths), len(lengths)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device, torch.bfloat16).requires_grad_()

    query = leaf(tokens, heads, head_dim)
    key, value = leaf(tokens, kv_heads, head_dim), leaf(tokens, kv_heads, head_dim)
    prefix = (leaf(batch, kv_heads, prefix_len, head_dim), leaf(batch, kv_heads, prefix_len, head_dim)) \
        if prefix_len else None
    inputs = [query, key, value, *(prefix or ())]
    mask = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]
    layout, scale = TokenLayout.from_mask(mask).to(device), head_dim ** -0.5
    cotangent = torch.randn(tokens, heads, head_dim, generator=generator).to(device)

    def draw(seed: int) -> tuple[torch.Tensor, ...]:
        """The kernel's output (fp32) and the gradients of the inputs under `cotangent`."""
        torch.manual_seed(seed)
        out = run_kernel(Packing(layout, kernel), query, key, value, scale, dropout, causal, window, None, prefix)
        grads = torch.autograd.grad((out.float() * cotangent).sum(), inputs)
        return out.detach().float(), *grads

    fp32 = [t.detach().float().requires_grad_() for t in inputs]
    fp32_prefix = (fp32[3], fp32[4]) if prefix else None
    theirs = reference(fp32[0], fp32[1], fp32[2], lengths, causal, window, fp32_prefix, scale)
    theirs_grads = torch.autograd.grad((theirs * cotangent).sum(), fp32)
    theirs = theirs.detach()
    notes: list[str] = []
    if dropout:
        first = draw(0)
        if not torch.equal(first[0], draw(0)[0]):
            notes.append("the same seed drew another output")
        if relative_error(first[0], theirs) < DROPPED:
            notes.append("no dropout applied")
        totals = list(first)
        for seed in range(1, draws):
            totals = [total + part for total, part in zip(totals, draw(seed), strict=True)]
        ours, *ours_grads = (total / draws for total in totals)
    else:
        ours, *ours_grads = draw(0)
    tolerance = dropout_tolerance(dropout, draws) if dropout else TOLERANCE
    forward = relative_error(ours, theirs)
    backward = max(relative_error(a, b) for a, b in zip(ours_grads, theirs_grads, strict=True))
    if not (forward <= tolerance and backward <= tolerance and math.isfinite(forward + backward)):
        notes.append("beyond tolerance")
    return {**row, "forward rel. error": forward, "backward rel. error": backward,
            "result": f"fail: {'; '.join(notes)}" if notes else "pass"}


def kernel_rows(device: torch.device, smoke: bool) -> list[dict[str, Any]]:
    """Every kernel on every case (a failure is its row's result, the others still run)."""
    lengths, head_dim, draws = (SMOKE_LENGTHS, 16, SMOKE_DRAWS) if smoke else (LENGTHS, 64, DRAWS)
    rows = []
    for kernel in KERNEL_NAMES:
        for case in CASES:
            try:
                rows.append(check(kernel, case, device, lengths, head_dim, draws))
            except Exception as error:  # one kernel failing must not hide the others
                rows.append({"kernel": kernel, "case": case, "result": f"fail: {type(error).__name__}: {error}"[:300]})
    return rows
