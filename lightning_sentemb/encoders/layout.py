"""Where the real tokens of a padded batch sit (`TokenLayout`), and moving tensors between the padded,
packed and aligned layouts: what the packed forward and its attention kernels share."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


class TokenLayout:
    """Where the real tokens of a padded (batch, width) batch sit.

    `index`: the flat position of every real token in the padded layout (row-major); `aligned`: its
    flat position once each sentence is moved to the start of its row (the `aligned` kernel's layout);
    `lengths`: tokens per row; `offsets`: where each sentence starts among the packed tokens (int32,
    batch + 1 entries, the fused kernels' `cu_seqlens`). Built on the CPU (`from_mask`), with the row
    lengths kept on the host as well, so the token count, the longest row and a gradient-cache chunk
    (`rows`) are known without reading anything back from the device. Lightning and the DataLoader move
    and pin it with the batch (`to`, `pin_memory`)."""

    def __init__(self, index: Tensor, aligned: Tensor, lengths: Tensor, offsets: Tensor, host_lengths: list[int],
                 width: int) -> None:
        self.index = index
        self.aligned = aligned
        self.lengths = lengths
        self.offsets = offsets
        self.host_lengths = host_lengths
        self.width = width
        self._head_rows: dict[int, tuple[Tensor, Tensor, Tensor]] = {}

    @classmethod
    def from_mask(cls, attention_mask: Tensor) -> TokenLayout:
        """The layout of a (batch, width) 0/1 mask; on a GPU tensor this reads the mask back once."""
        mask = attention_mask.detach().to("cpu", torch.bool)
        lengths = mask.sum(1)
        width = mask.shape[1]
        aligned = torch.arange(width)[None] < lengths[:, None]
        offsets = F.pad(lengths.cumsum(0), (1, 0)).int()
        return cls(mask.flatten().nonzero().squeeze(1), aligned.flatten().nonzero().squeeze(1), lengths, offsets,
                   lengths.tolist(), width).to(attention_mask.device)

    @property
    def batch(self) -> int:
        return len(self.host_lengths)

    @property
    def max_length(self) -> int:
        return max(self.host_lengths)

    def _tensors(self) -> list[Tensor]:
        return [self.index, self.aligned, self.lengths, self.offsets]

    def to(self, device: torch.device | str, non_blocking: bool = True) -> TokenLayout:
        if self.index.device == torch.device(device):
            return self
        return TokenLayout(*[t.to(device, non_blocking=non_blocking) for t in self._tensors()], self.host_lengths,
                           self.width)

    def pin_memory(self) -> TokenLayout:
        return TokenLayout(*[t.pin_memory() for t in self._tensors()], self.host_lengths, self.width)

    def rows(self, span: slice) -> TokenLayout:
        """The layout of rows `span` alone (a gradient-cache chunk): token offsets from the host lengths."""
        first, last, step = span.indices(self.batch)
        if step != 1:
            raise ValueError(f"a layout is cut into consecutive rows, not {span}")
        start = sum(self.host_lengths[:first])
        stop = start + sum(self.host_lengths[first:last])
        shift = first * self.width
        return TokenLayout(self.index[start:stop] - shift, self.aligned[start:stop] - shift, self.lengths[first:last],
                           self.offsets[first:last + 1] - start, self.host_lengths[first:last], self.width)

    def __getitem__(self, span: slice) -> TokenLayout:
        return self.rows(span)

    # ----- moving tensors between layouts ---------------------------------------------------
    def pack(self, padded: Tensor) -> Tensor:
        """(batch, width, ...) -> (tokens, ...). `index_select`, not `[index]`: its backward is an
        index_add, several times faster on CPU than advanced indexing's accumulating index_put."""
        return padded.flatten(0, 1).index_select(0, self.index)

    def unpack(self, packed: Tensor) -> Tensor:
        """(tokens, ...) -> (batch, width, ...) in the input's layout, zeros at padding."""
        out = packed.new_zeros(self.batch * self.width, *packed.shape[1:])
        return out.index_copy(0, self.index, packed).unflatten(0, (self.batch, self.width))

    def align_heads(self, packed: Tensor) -> Tensor:
        """(tokens, heads, d) -> (batch, heads, width, d), contiguous, each sentence from position 0: one
        gather, no transposing copy, and a gather in backward (`_HeadGather`). Padding positions repeat the
        sentence's last token rather than hold zeros: attention masks them as keys and `unalign_heads`
        drops them as queries, so they get and give exact zeros in backward."""
        tokens, heads, dim = packed.shape
        gather, scatter, _ = self.head_rows(heads)
        out = _HeadGather.apply(packed.reshape(tokens * heads, dim), gather, scatter, None)
        return out.view(self.batch, heads, self.width, dim)

    def unalign_heads(self, aligned: Tensor) -> Tensor:
        """(batch, heads, width, d) -> (tokens, heads, d): `align_heads` undone; its backward puts zeros at
        padding positions (a padding query must send nothing back to the keys)."""
        batch, heads, width, dim = aligned.shape
        gather, scatter, real = self.head_rows(heads)
        rows = aligned.reshape(batch * heads * width, dim)
        return _HeadGather.apply(rows, scatter, gather, real).view(-1, heads, dim)

    def head_rows(self, heads: int) -> tuple[Tensor, Tensor, Tensor]:
        """For `heads` heads: the rows `align_heads` gathers from (tokens · heads) packed rows, those
        `unalign_heads` gathers back, and which aligned rows are real; built on the device once per layout
        (every layer reuses them)."""
        if heads not in self._head_rows:
            device, width = self.lengths.device, self.width
            position = torch.arange(width, device=device)
            last = (self.lengths - 1).clamp(min=0)
            token = (self.offsets[:-1, None].long() + torch.minimum(position[None], last[:, None])).clamp(
                max=max(sum(self.host_lengths) - 1, 0))
            head = torch.arange(heads, device=device)
            gather = (token[:, None, :] * heads + head[None, :, None]).flatten()
            sentence, at = self.aligned // width, self.aligned % width
            scatter = ((sentence * heads * width + at)[:, None] + head[None] * width).flatten()
            real = (position[None] < self.lengths[:, None])[:, None, :].expand(-1, heads, -1).reshape(-1, 1)
            self._head_rows[heads] = gather, scatter, real
        return self._head_rows[heads]

    def key_mask(self) -> Tensor:
        """(batch, width) True at real tokens of the aligned layout."""
        return torch.arange(self.width, device=self.lengths.device)[None] < self.lengths[:, None]

    def with_prefix(self, key: Tensor, value: Tensor, prefix: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """Packed keys and values (tokens, heads, d) with each sentence's prefix (batch, heads, prefix_len,
        d) put before it, and the offsets of those longer sequences: what a fused kernel takes."""
        batch, _, prefix_len, _ = prefix[0].shape
        tokens, device = key.shape[0], key.device
        sentence = torch.repeat_interleave(torch.arange(batch, device=device), self.lengths, output_size=tokens)
        token_dest = torch.arange(tokens, device=device) + (sentence + 1) * prefix_len
        starts = self.offsets[:-1].long() + torch.arange(batch, device=device) * prefix_len
        prefix_dest = (starts[:, None] + torch.arange(prefix_len, device=device)).flatten()

        def prepend(packed: Tensor, before: Tensor) -> Tensor:
            out = packed.new_empty(tokens + batch * prefix_len, *packed.shape[1:]).index_copy(0, token_dest, packed)
            return out.index_copy(0, prefix_dest, before.to(packed.dtype).transpose(1, 2).flatten(0, 1))

        offsets = self.offsets + prefix_len * torch.arange(batch + 1, device=device, dtype=self.offsets.dtype)
        return prepend(key, prefix[0]), prepend(value, prefix[1]), offsets


def layout_of(features: dict[str, Any]) -> TokenLayout:
    """The batch's `layout` (built with it), on the inputs' device; built here when absent (a batch
    made elsewhere, e.g. by sentence-transformers: one read-back of the mask)."""
    mask = features["attention_mask"]
    layout = features.get("layout")
    return TokenLayout.from_mask(mask) if layout is None else layout.to(mask.device)


class _HeadGather(torch.autograd.Function):
    """rows[index], whose backward is a gather by `inverse` too, where autograd's would be an index_add of
    head-sized rows (several times slower on CPU). Exact where every source row is gathered once at a real
    position and the gradients at the other (padding) positions are zeros; `real`, when given, zeros the
    gradient at the padding positions of the output."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, index: Tensor, inverse: Tensor, real: Tensor | None) -> Tensor:
        ctx.save_for_backward(inverse, real)
        return rows.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        inverse, real = ctx.saved_tensors
        grad = grad.index_select(0, inverse)
        return (grad if real is None else grad.masked_fill_(~real, 0)), None, None, None
