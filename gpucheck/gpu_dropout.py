"""gpu-check's attention-dropout checks (`gpu_kernels`), exact where the kernel can say which probabilities
it dropped.

- The flash op (`varlen` with dropout calls aten's `_flash_attention_forward`): the kernel's call is
  recorded (`recorded_flash_calls`) and replayed from the same seed with `return_debug_mask=True`, which
  returns the dropout mask that call drew (`flash_keep_masks`); the replay's output must equal the
  kernel's (same mask), and the kernel's output and gradients must equal the fp32 reference attention
  under that mask with the 1 / (1 − p) rescale (`gpu_attention.reference`), within bf16's tolerance. A
  kernel that forgot the rescale is p off (0.1), three times the tolerance; one that dropped other
  probabilities than its mask says is off by the dropped ones' share. The share of dropped probabilities
  must be p within its noise (`fraction_tolerance`).
- Kernels that cannot return their mask (`aligned`: SDPA with a key mask, whose memory-efficient kernel
  draws inside; `nested`: nested SDPA; `varlen_attn`, which runs no dropout at all): on values of 1 every
  output is the sum of the kept probabilities times 1 / (1 − p), whose mean over tokens, heads and draws
  is 1 within its noise (`rescale_tolerance`), and 1 − p (0.9) without the rescale or p′ / p off when
  another rate is drawn; `gpu_kernels` also compares the mean of many draws with the reference.

`flash_stand_in` is aten's op written out on the CPU (with its debug-mask encoding), so the smoke run
exercises the recording, the replay, the decoding and the comparison without a GPU; it checks the
comparison, not a kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from gpu_attention import TOLERANCE, allowed_keys, attend, probabilities, reference, relative_error

from lightning_sentemb.encoders import kernels

RESCALE_ROUNDING = 1e-2  # bf16 outputs of about 1 round by ≤ 2⁻⁸ each
SAME_MASK = 2e-2  # a replay under another mask differs by about sqrt(p) of the output


def flash_keep_masks(debug_mask: torch.Tensor, lengths: list[int], key_lengths: list[int]) -> list[torch.Tensor]:
    """Each sentence's (heads, length, keys) keep mask from the flash op's debug mask: (batch, heads, longest
    query rounded up, longest key run rounded up), sentence b's probabilities from its corner [b, :, 0, 0],
    a dropped one with its sign bit set (flash-attention 2's encoding, as torch's own tests read it)."""
    signs = torch.signbit(debug_mask.float())  # fp32 keeps the sign (and -0.0's)
    return [~signs[b, :, :length, :keys] for b, (length, keys) in enumerate(zip(lengths, key_lengths, strict=True))]


def encode_flash_mask(probs: list[torch.Tensor], keep: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The debug mask the flash op would return for `probs` under `keep` (`flash_keep_masks` inverts it)."""
    heads = probs[0].shape[0]
    rounded = [128 * math.ceil(max(p.shape[i] for p in probs) / 128) for i in (1, 2)]
    debug = torch.zeros(len(probs), heads, *rounded, dtype=dtype, device=probs[0].device)
    for b, (p, kept) in enumerate(zip(probs, keep, strict=True)):
        debug[b, :, :p.shape[1], :p.shape[2]] = torch.where(kept, p, -p)
    return debug


def flash_stand_in(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
                   *, scale=None, **unused: Any) -> tuple[Any, ...]:
    """aten's `_flash_attention_forward` written out on the CPU: attention per sentence with a dropout mask
    drawn from torch's generator (seeded: a replay draws the same), kept probabilities times 1 / (1 − p);
    its five outputs, the mask encoded as the op encodes it when asked."""
    lengths, key_lengths = cum_seq_q.diff().tolist(), cum_seq_k.diff().tolist()
    probs = probabilities(query, key, lengths, key_lengths, is_causal, None, scale)
    keep = [torch.rand(p.shape) >= dropout_p for p in probs]
    out = attend(probs, value, key_lengths, keep, dropout_p).to(query.dtype)
    debug = encode_flash_mask(probs, keep, query.dtype) if return_debug_mask else query.new_empty(0)
    return out, None, None, None, debug


@contextmanager
def recorded_flash_calls(op: Callable[..., tuple[Any, ...]]) -> Iterator[list[tuple[tuple, dict]]]:
    """Inside the block, the `varlen` kernel calls `op` as aten's flash op, each call's arguments kept."""
    calls: list[tuple[tuple, dict]] = []

    def record(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
        calls.append((args, kwargs))
        return op(*args, **kwargs)

    installed = kernels.installed_flash_forward
    kernels.installed_flash_forward = lambda: record
    try:
        yield calls
    finally:
        kernels.installed_flash_forward = installed


def fraction_tolerance(dropout: float, count: int) -> float:
    """Five standard deviations of the dropped share of `count` probabilities dropped with chance p."""
    return 5 * math.sqrt(dropout * (1 - dropout) / max(count, 1))


def rescale_tolerance(probs: list[torch.Tensor], dropout: float, draws: int) -> float:
    """`RESCALE_ROUNDING` plus five standard deviations of the mean output on values of 1 over `draws`
    draws: one (token, head)'s output Σ keep · a / (1 − p) has variance p / (1 − p) · Σ a²."""
    rows = sum(p.shape[0] * p.shape[1] for p in probs)
    variance = dropout / (1 - dropout) * sum(float(p.square().sum()) for p in probs) / rows**2 / draws
    return RESCALE_ROUNDING + 5 * math.sqrt(variance)


def against_own_mask(call: tuple[tuple, dict], op: Callable[..., tuple[Any, ...]], seed: int,
                     ours: list[torch.Tensor], inputs: list[torch.Tensor], cotangent: torch.Tensor,
                     lengths: list[int], case: tuple[bool, int | None, float, float]) -> dict[str, Any]:
    """The kernel's draw `ours` (output and the gradients of `inputs` under `cotangent`) against the fp32
    reference under the mask the flash op drew for `call` at `seed`. `inputs`: query, key, value (and
    the prefix's key, value), fp32; `case`: causal, window, scale, dropout. Columns of the row, with
    `notes` (failures)."""
    causal, window, scale, dropout = case
    args, keywords = call[0][:9], {k: v for k, v in call[1].items() if k != "return_debug_mask"}
    torch.manual_seed(seed)
    with torch.no_grad():
        replay = op(*(a.detach() if torch.is_tensor(a) else a for a in args), True, **keywords)
    debug = replay[4]
    if debug is None or debug.numel() == 0:
        return {"notes": [], "mask": "the flash op returned no debug mask"}
    prefix_len = inputs[3].shape[2] if len(inputs) > 3 else 0
    key_lengths = [length + prefix_len for length in lengths]
    keep = flash_keep_masks(debug, lengths, key_lengths)
    prefix = (inputs[3], inputs[4]) if prefix_len else None
    theirs = reference(*inputs[:3], lengths, causal, window, prefix, scale, keep, dropout)
    theirs_grads = torch.autograd.grad((theirs * cotangent).sum(), inputs)
    allowed = [allowed_keys(length, keys, causal, window, debug.device).expand_as(kept)
               for length, keys, kept in zip(lengths, key_lengths, keep, strict=True)]  # the rest is not written
    count = sum(int(a.sum()) for a in allowed)
    dropped = sum(int((~kept & a).sum()) for kept, a in zip(keep, allowed, strict=True)) / count
    columns = {"mask": "the op's own (return_debug_mask)", "dropped share": dropped,
               "forward rel. error": relative_error(ours[0], theirs),
               "backward rel. error": max(relative_error(a, b) for a, b in zip(ours[1:], theirs_grads, strict=True))}
    notes = []
    if relative_error(replay[0], ours[0]) > SAME_MASK:
        notes.append("the replay with return_debug_mask drew another output")
    if abs(dropped - dropout) > fraction_tolerance(dropout, count):
        notes.append(f"dropped {dropped:.3f} of the probabilities, not {dropout}")
    if not (columns["forward rel. error"] <= TOLERANCE and columns["backward rel. error"] <= TOLERANCE):
        notes.append("beyond tolerance of the reference under the op's own mask")
    return {**columns, "notes": notes}
