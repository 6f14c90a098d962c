"""The attention kernels of the packed forward, and the one function that picks among them.

Every kernel takes the packed rows, query (tokens, heads, d) and key / value (tokens, kv_heads, d), and
attends within each sentence of the batch's `TokenLayout`:

| kernel | where `auto` runs it | what it needs |
|---|---|---|
| `varlen` | CUDA sm80+, fp16/bf16 | flash: torch's `varlen_attn`; with attention dropout the aten op beneath it |
| `nested` | CUDA, fp16/bf16, no `varlen`, no dropout, no window | SDPA on nested jagged tensors |
| `aligned` | everything else: CPU, fp32, soft-capping, a prefix on causal layers | SDPA on re-padded sentences |

`nested` runs flash on sm80+ and the memory-efficient kernel on a V100 (sm70, fp16 only).

`choose_kernel` is the whole choice, a pure function of what torch offers (`torch_features`, read once), the
device and the call; the kernels that ran are counted (`kernels_ran`) and each logged the first time.
"""

from __future__ import annotations

import functools
import inspect
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from .layout import TokenLayout

Kernel = Literal["auto", "aligned", "varlen", "nested"]
KERNEL_NAMES = ("varlen", "nested", "aligned")
HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class TorchFeatures:
    """What the installed torch offers the fused kernels. `varlen`: `varlen_attn` imports and takes a
    `scale` and a causal switch; `varlen_gqa_keyword`: it takes `enable_gqa` (torch ≥ 2.13; before,
    e.g. 2.11, flash runs grouped-query heads natively, without the keyword); `varlen_window`: it takes
    `window_size` (else `is_causal`, and no sliding windows); `flash_dropout`: aten's
    `_flash_attention_forward`, the op beneath `varlen_attn` (which calls it with dropout 0) and nested
    SDPA (which passes the dropout on), so `varlen` also trains with attention dropout; `nested`: SDPA on
    nested jagged tensors."""

    varlen: bool = False
    varlen_gqa_keyword: bool = False
    varlen_window: bool = False
    flash_dropout: bool = False
    nested: bool = False


def features_of(varlen_attn: Callable[..., Tensor] | None,
                flash_forward: Callable[..., tuple[Tensor, ...]] | None = None) -> TorchFeatures:
    """The features of this torch, given its `varlen_attn` and aten's `_flash_attention_forward` (None
    where they do not exist)."""
    jagged = getattr(torch.nested, "nested_tensor_from_jagged", None)
    nested = jagged is not None and "max_seqlen" in inspect.signature(jagged).parameters
    keywords = {} if varlen_attn is None else inspect.signature(varlen_attn).parameters
    usable = "scale" in keywords and ("window_size" in keywords or "is_causal" in keywords)
    return TorchFeatures(varlen=usable, varlen_gqa_keyword=usable and "enable_gqa" in keywords,
                         varlen_window=usable and "window_size" in keywords, flash_dropout=flash_forward is not None,
                         nested=nested)


def installed_varlen() -> Callable[..., Tensor] | None:
    """torch's `varlen_attn`, looked up at each call (tests stand another one in); None before it existed."""
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None
    return getattr(varlen, "varlen_attn", None)


def installed_flash_forward() -> Callable[..., tuple[Tensor, ...]] | None:
    """aten's `_flash_attention_forward` (differentiable: its backward is registered with autograd), looked
    up at each call (tests stand another one in); None where this torch has no such op."""
    return getattr(torch.ops.aten, "_flash_attention_forward", None)


@functools.cache
def torch_features() -> TorchFeatures:
    """`features_of` the installed torch, read once (`torch_features.cache_clear()` to read again)."""
    return features_of(installed_varlen(), installed_flash_forward())


@functools.cache
def device_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) compute capability of a CUDA device, None elsewhere; asked once per device."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def choose_kernel(features: TorchFeatures, device_type: str, capability: tuple[int, int] | None, dtype: torch.dtype,
                  dropout: float, causal: bool, window: int | None, softcap: float | None, prefix: bool) -> str:
    """The kernel `auto` runs for one attention call. The fused kernels run fp16/bf16 on CUDA without
    soft-capping; with a prefix (keys longer than queries) on bidirectional layers only. Flash needs sm80+
    (the only bf16 GPUs too); before that (V100, fp16) the memory-efficient kernel runs nested tensors.
    With attention dropout (BERT-family training) `varlen` calls the flash op itself (no window then);
    where that op is missing, or on a V100, `aligned` (SDPA with a key mask), never `nested`: nested
    tensors with dropout ran 6x slower than padded SDPA on an H200 (torch 2.11, bert-base SimCSE
    training: 285 against 1,827 sentences/s, docs/benchmarks.md)."""
    if device_type != "cuda" or dtype not in HALF or softcap is not None or (prefix and (causal or window)):
        return "aligned"
    if capability is None or capability < (7, 0) or (dtype == torch.bfloat16 and capability < (8, 0)):
        return "aligned"
    if capability >= (8, 0) and varlen_runs(features, dropout, window):
        return "varlen"
    if features.nested and not window and dropout == 0:
        return "nested"
    return "aligned"


def varlen_runs(features: TorchFeatures, dropout: float, window: int | None) -> bool:
    """Whether this torch runs `varlen` for the call: `varlen_attn` without dropout (with `window_size`
    for a window), the flash op itself with dropout (no window)."""
    if dropout > 0:
        return features.flash_dropout and not window
    return features.varlen and (not window or features.varlen_window)


@dataclass
class Packing:
    """What the attention function is handed in a packed forward: the layout, the kernel to use, and
    whether any attention ran through it (a model that bypasses the interface must not pass silently)."""

    layout: TokenLayout
    kernel: Kernel = "auto"
    attended: bool = False


_ran: Counter[str] = Counter()


def kernels_ran() -> dict[str, int]:
    """Attention calls per kernel in this process since the last `reset_kernels_ran` (gpu-check's report)."""
    return dict(_ran)


def reset_kernels_ran() -> None:
    _ran.clear()


def note_kernel(kernel: str, query: Tensor, dropout: float, causal: bool, window: int | None) -> None:
    """Count one call of `kernel`; the first of each kernel in the process is logged (info, rank zero)."""
    if kernel not in _ran:
        rank_zero_info(f"packed attention: the {kernel} kernel runs ({query.device.type}, {query.dtype}, dropout "
                       f"{dropout:g}, {'causal' if causal else 'bidirectional'}"
                       f"{f', window {window}' if window else ''})")
    _ran[kernel] += 1


@torch.compiler.disable  # Python state (host lengths, the kernel record) stays out of compiled layers
def run_kernel(packing: Packing, query: Tensor, key: Tensor, value: Tensor, scale: float, dropout_p: float,
               causal: bool, window: int | None, softcap: float | None,
               prefix: tuple[Tensor, Tensor] | None) -> Tensor:
    """Attention within each sentence of packed rows: query (tokens, heads, d), key and value
    (tokens, kv_heads, d) with kv_heads dividing heads; returns (tokens, heads, d). `window`:
    transformers' `sliding_window`, keys closer than that (causal: at most window - 1 back;
    bidirectional: |i - j| < window). The packing's kernel, forced or `auto` (`choose_kernel`)."""
    packing.attended = True
    features, kernel, layout = torch_features(), packing.kernel, packing.layout
    if kernel == "auto":
        kernel = choose_kernel(features, query.device.type, device_capability(query.device), query.dtype, dropout_p,
                               causal, window, softcap, prefix is not None)
    note_kernel(kernel, query, dropout_p, causal, window)
    if kernel == "varlen":
        if not varlen_runs(features, dropout_p, window):
            needs = ("aten's _flash_attention_forward and no sliding window" if dropout_p > 0 else
                     f"torch.nn.attention.varlen.varlen_attn{' with window_size' if window else ''}")
            raise ValueError(f"the varlen kernel needs {needs} (torch {torch.__version__}): use kernel 'auto'")
        return varlen_attention(query, key, value, layout, scale, dropout_p, causal, window, prefix)
    if kernel == "nested":
        if causal and not query.is_cuda or window or softcap is not None:
            raise ValueError("the nested kernel runs neither windows nor soft-capping, nor causal attention on CPU")
        return nested_attention(query, key, value, layout, scale, dropout_p, causal, prefix)
    return aligned_attention(query, key, value, layout, scale, dropout_p, causal, window, softcap, prefix)


def varlen_attention(query: Tensor, key: Tensor, value: Tensor, layout: TokenLayout, scale: float, dropout_p: float,
                     causal: bool, window: int | None, prefix: tuple[Tensor, Tensor] | None) -> Tensor:
    """torch's fused variable-length flash kernel, called with the keywords this torch's `varlen_attn`
    takes (`torch_features`); a prefix makes each sentence's keys longer than its queries (`auto` sends
    it here on bidirectional layers only). `varlen_attn` runs without dropout, so with attention dropout
    the flash op it wraps runs directly, as nested SDPA calls it (grouped-query heads natively)."""
    features = torch_features()
    key_offsets, key_max = layout.offsets, layout.max_length
    if prefix is not None:
        key, value, key_offsets = layout.with_prefix(key, value, prefix)
        key_max += prefix[0].shape[2]
    query, key, value = (t.contiguous() for t in (query, key, value))  # rotary models hand over strided views
    if dropout_p > 0:
        return installed_flash_forward()(query, key, value, layout.offsets, key_offsets, layout.max_length, key_max,
                                         dropout_p, causal, False, scale=scale)[0]
    options: dict[str, Any] = {"scale": scale}
    if features.varlen_window:
        reach = -1 if window is None else window - 1
        options["window_size"] = (reach, 0 if causal else reach)
    else:
        options["is_causal"] = causal
    if features.varlen_gqa_keyword:
        options["enable_gqa"] = key.shape[1] != query.shape[1]
    return installed_varlen()(query, key, value, layout.offsets, key_offsets, layout.max_length, key_max, **options)


def nested_attention(query: Tensor, key: Tensor, value: Tensor, layout: TokenLayout, scale: float, dropout_p: float,
                     causal: bool, prefix: tuple[Tensor, Tensor] | None) -> Tensor:
    """SDPA over nested jagged tensors (flash / memory-efficient kernels with dropout on CUDA).
    Grouped-query keys are repeated per head here: the nested kernels take no `enable_gqa`."""
    key_offsets, extra = layout.offsets, 0
    if prefix is not None:
        key, value, key_offsets = layout.with_prefix(key, value, prefix)
        extra = prefix[0].shape[2]
    groups = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(groups, dim=1) if groups > 1 else t for t in (key, value))
    shortest, longest = min(layout.host_lengths), layout.max_length  # from the host: no read-back

    def nested(values: Tensor, offsets: Tensor, more: int = 0) -> Tensor:
        return torch.nested.nested_tensor_from_jagged(values, offsets.long(), min_seqlen=shortest + more,
                                                      max_seqlen=longest + more).transpose(1, 2)

    out = F.scaled_dot_product_attention(nested(query, layout.offsets), nested(key, key_offsets, extra),
                                         nested(value, key_offsets, extra), dropout_p=dropout_p, is_causal=causal,
                                         scale=scale)
    return out.transpose(1, 2).values()


def aligned_attention(query: Tensor, key: Tensor, value: Tensor, layout: TokenLayout, scale: float, dropout_p: float,
                      causal: bool, window: int | None, softcap: float | None,
                      prefix: tuple[Tensor, Tensor] | None) -> Tensor:
    """Each sentence re-padded from position 0 (causal and windowed masks are then plain triangles and
    bands, whichever side the batch was padded on), SDPA with a boolean mask, or `math_attention`
    (dropout on CPU, soft-capping)."""
    heads, kv_heads = query.shape[1], key.shape[1]
    query, key, value = (layout.align_heads(t) for t in (query, key, value))  # (batch, h, width, d)
    real = layout.key_mask()
    mask = real[:, None, None, :]
    if causal or window:
        positions = torch.arange(layout.width, device=query.device)
        distance = positions[:, None] - positions[None, :]
        allowed = distance >= 0 if causal else torch.ones_like(distance, dtype=torch.bool)
        if window:
            allowed &= distance.abs() < window
        # padding queries (dropped afterwards) see every key: a row with none would make a NaN, and the
        # backward 0 · NaN in the real keys' gradients
        mask = (mask & allowed) | ~real[:, None, :, None]
    if prefix is not None:
        key, value, mask = join_prefix(key, value, mask, prefix)
    if (dropout_p > 0 and query.device.type == "cpu") or softcap is not None:
        context = math_attention(query, key, value, mask, dropout_p, scale, softcap)
    else:
        context = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                                 enable_gqa=kv_heads != heads)
    return layout.unalign_heads(context)


def math_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, dropout_p: float, scale: float,
                   softcap: float | None = None) -> Tensor:
    """softmax(scale · q kᵀ + mask) with dropout on the probabilities, times v: what
    `scaled_dot_product_attention` computes, written as batched GEMMs. With dropout on, SDPA on CPU
    falls back to its math kernel, which copies every (batch, heads, length, length) tensor several times.
    On CPU, half-precision inputs run in fp32, as in SDPA's math kernel: on a CPU without bf16 GEMMs
    (AVX2) a bf16 bmm at 1536 × 32 × 32 × 32 took 94 ms against 1.7 ms in fp32. `softcap`: scores
    soft-capped as cap · tanh(scores / cap) before the mask (Gemma-2).
    query (batch, heads, length, d); key, value (batch, kv_heads, key_length, d): the query heads of a
    key/value head are stacked along the length instead of copying its keys per head. `mask` broadcasts
    to (batch, heads, length, key_length), True where a query may see a key."""
    if query.device.type == "cpu" and query.dtype in HALF:
        with torch.autocast("cpu", enabled=False):
            context = math_attention(query.float(), key.float(), value.float(), mask, dropout_p, scale, softcap)
        return context.to(value.dtype)
    batch, heads, length, head_dim = query.shape
    kv_heads, key_length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    rows = batch * kv_heads
    query = query.reshape(rows, groups * length, head_dim)
    bias = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(~mask, float("-inf"))
    if mask.shape[1] == mask.shape[2] == 1:  # one row of keys per sentence: broadcast over the queries
        bias = bias.expand(batch, kv_heads, 1, key_length).reshape(rows, 1, key_length)
    else:
        bias = bias.expand(batch, heads, length, key_length).reshape(rows, groups * length, key_length)
    keys_t = key.reshape(rows, key_length, head_dim).transpose(1, 2)
    if softcap is None:
        scores = torch.baddbmm(bias, query, keys_t, alpha=scale)
    else:
        scores = torch.tanh(torch.bmm(query, keys_t) * (scale / softcap)) * softcap + bias
    probs = F.dropout(scores.softmax(-1), dropout_p)
    context = torch.bmm(probs.to(value.dtype), value.reshape(rows, key_length, head_dim))
    return context.view(batch, heads, length, head_dim)


def join_prefix(key: Tensor, value: Tensor, mask: Tensor, prefix: tuple[Tensor, Tensor]) -> tuple[Tensor, ...]:
    """(batch, heads, length, d) keys and values with the prefix's before them, and the boolean mask with
    the prefix visible to every query."""
    key = torch.cat([prefix[0].to(key.dtype), key], dim=2)
    value = torch.cat([prefix[1].to(value.dtype), value], dim=2)
    return key, value, torch.cat([mask.new_ones(*mask.shape[:-1], prefix[0].shape[2]), mask], dim=-1)
