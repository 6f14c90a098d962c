"""The reference the packed-attention kernels are checked against (`gpu_kernels`, `gpu_dropout`): attention
written out in fp32, sentence by sentence, independent of the kernels (SDPA, flash, `math_attention`), with
an optional dropout mask applied as inverted dropout does (kept probabilities times 1 / (1 − p)).

Packed rows: query (tokens, heads, d), key / value (key tokens, kv_heads, d), sentence b's queries the
`lengths[b]` rows after the previous sentences', its keys the `key_lengths[b]` rows likewise. A sentence
with more keys than queries has a prefix: its first keys, visible to every query (DCPCSE's prefixes; the
flash op aligns a causal mask to the last key, which is the same). Grouped-query heads: query head h reads
key / value head h // (heads / kv_heads).
"""

from __future__ import annotations

import torch

TOLERANCE = 3e-2  # bf16 keeps 8 significant bits: a few times its unit roundoff
DRAWS, SMOKE_DRAWS = 256, 2  # the mean of draws of aligned and nested (gpu_kernels)
RESCALE_DRAWS, SMOKE_RESCALE_DRAWS = 32, 8  # forward draws on values of 1


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """‖ours − theirs‖ / ‖theirs‖ (fp32)."""
    ours, theirs = ours.detach().float(), theirs.detach().float()
    return float((ours - theirs).norm() / theirs.norm().clamp_min(1e-12))


def wide(tensor: torch.Tensor) -> torch.Tensor:
    """fp32 (fp64 stays fp64: the tests check this reference against torch's in fp64)."""
    return tensor if tensor.dtype == torch.float64 else tensor.float()


def allowed_keys(length: int, keys: int, causal: bool, window: int | None, device: torch.device) -> torch.Tensor:
    """(length, keys) True where a query sees a key: the prefix (the first keys − length) always, the
    sentence's own keys within the causal triangle and the window band (|i − j| < window)."""
    distance = torch.arange(length, device=device)[:, None] - torch.arange(length, device=device)[None]
    allowed = distance >= 0 if causal else torch.ones_like(distance, dtype=torch.bool)
    if window:
        allowed &= distance.abs() < window
    return torch.cat([allowed.new_ones(length, keys - length), allowed], dim=1)


def probabilities(query: torch.Tensor, key: torch.Tensor, lengths: list[int], key_lengths: list[int], causal: bool,
                  window: int | None, scale: float) -> list[torch.Tensor]:
    """Each sentence's attention probabilities (`wide`), (heads, length, keys)."""
    groups = query.shape[1] // key.shape[1]
    out, start, key_start = [], 0, 0
    for length, keys in zip(lengths, key_lengths, strict=True):
        q = wide(query[start:start + length].transpose(0, 1))
        k = wide(key[key_start:key_start + keys].transpose(0, 1)).repeat_interleave(groups, 0)
        scores = (q @ k.transpose(1, 2)) * scale
        allowed = allowed_keys(length, keys, causal, window, query.device)
        out.append(scores.masked_fill(~allowed, float("-inf")).softmax(-1))
        start, key_start = start + length, key_start + keys
    return out


def attend(probs: list[torch.Tensor], value: torch.Tensor, key_lengths: list[int],
           keep: list[torch.Tensor] | None = None, dropout: float = 0.0) -> torch.Tensor:
    """Σ probability · value per sentence, (tokens, heads, d) (`wide`); with `keep` (per sentence, the shape of
    its probabilities) the dropped probabilities zeroed and the kept ones times 1 / (1 − dropout)."""
    groups = probs[0].shape[0] // value.shape[1]
    out, key_start = [], 0
    for row, (p, keys) in enumerate(zip(probs, key_lengths, strict=True)):
        v = wide(value[key_start:key_start + keys].transpose(0, 1)).repeat_interleave(groups, 0)
        if keep is not None:
            p = p * keep[row] / (1 - dropout)
        out.append((p @ v).transpose(0, 1))
        key_start += keys
    return torch.cat(out)


def with_prefix(packed: torch.Tensor, lengths: list[int], prefix: torch.Tensor | None) -> torch.Tensor:
    """Packed key (or value) rows with each sentence's prefix (batch, kv_heads, prefix, d) before its rows."""
    if prefix is None:
        return packed
    rows, start = [], 0
    for row, length in enumerate(lengths):
        rows += [prefix[row].transpose(0, 1).to(packed.dtype), packed[start:start + length]]
        start += length
    return torch.cat(rows)


def sentence_probabilities(query: torch.Tensor, key: torch.Tensor, lengths: list[int], causal: bool,
                           window: int | None, prefix_key: torch.Tensor | None, scale: float) -> list[torch.Tensor]:
    """`probabilities` of packed sentences of `lengths` with `prefix_key` (batch, kv_heads, prefix, d) before
    each sentence's keys."""
    key_lengths = [length + (prefix_key.shape[2] if prefix_key is not None else 0) for length in lengths]
    return probabilities(query, with_prefix(key, lengths, prefix_key), lengths, key_lengths, causal, window, scale)


def reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: list[int], causal: bool,
              window: int | None, prefix: tuple[torch.Tensor, torch.Tensor] | None, scale: float,
              keep: list[torch.Tensor] | None = None, dropout: float = 0.0) -> torch.Tensor:
    """fp32 attention of packed sentences of `lengths`, a `prefix` (key, value: (batch, kv_heads, prefix, d))
    before each sentence's keys, under an optional dropout mask `keep`; (tokens, heads, d)."""
    prefix_key, prefix_value = prefix if prefix is not None else (None, None)
    probs = sentence_probabilities(query, key, lengths, causal, window, prefix_key, scale)
    key_lengths = [p.shape[2] for p in probs]
    return attend(probs, with_prefix(value, lengths, prefix_value), key_lengths, keep, dropout)
