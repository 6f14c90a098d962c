"""Augmentations at the embedding layer (ConSERT): each training row carries its own edits, drawn on the
CPU by the method's collator (`methods.consert`), applied on the device in the forward, packed or padded.

Feature keys, each optional and one entry per row (gradient caching slices them by rows like the ids):

- `shuffle_index` (rows, width) long: the row's position ids gathered by it, a permutation of its real
  tokens (identity at padding): token shuffling on families that shuffle positions (`token_shuffle`);
- `position_shift` (rows,) long: added to every position id (a span kept where it stood in its sentence);
- `token_keep` (rows, width) bool: rows of the embedding output kept (token and span cutoff);
- `feature_keep` (rows, embedding width) bool: its columns kept (feature cutoff);
- `element_keep` (rows, width, embedding width) bool: its elements kept (dropout);
- `embedding_replacement` (rows, width, embedding width): the embedding output replaced (the adversarial
  view: another forward's output plus a perturbation).

"The embedding output" is what the family names (`BackboneFamily.embedding_output`): an encoder's
`embeddings` module (words, positions, token types, norm), a decoder's token embeddings. The edits act on
it through a forward hook for the one call, so the backbone's own forward runs unchanged, and a batch
without edit keys (evaluation, exports) runs the plain encoder.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from ..backbones import UnsupportedBackbone
from ..backbones.family import TokenShuffle
from .layout import TokenLayout, layout_of
from .plain import Encoder, PlainFormat


class EmbeddingLayerFormat(PlainFormat):
    """Plain rows, and what the collator's draws need to know of the embedding layer: the width of its
    output (feature cutoff, dropout) and how the family shuffles tokens (None: it cannot)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, embedding_width: int, token_shuffle: TokenShuffle | None):
        super().__init__(tokenizer)
        self.embedding_width = embedding_width
        self.token_shuffle = token_shuffle


def keep_mask(features: dict[str, Tensor]) -> Tensor | None:
    """The product of the row's keep masks, broadcastable to (rows, width, embedding width); None when none."""
    masks = [features["token_keep"][:, :, None]] if "token_keep" in features else []
    masks += [features["feature_keep"][:, None, :]] if "feature_keep" in features else []
    masks += [features["element_keep"]] if "element_keep" in features else []
    keep = masks[0] if masks else None
    for mask in masks[1:]:
        keep = keep & mask
    return keep


def to_layout(padded: Tensor, layout: TokenLayout | None, packed: bool) -> Tensor:
    """A (rows, width or 1, embedding width or 1) tensor in the forward's layout: itself, or its real tokens
    as one packed row (1, tokens, embedding width)."""
    if not packed:
        return padded
    rows, _, dims = padded.shape
    return layout.pack(padded.expand(rows, layout.width, dims))[None]


class AugmentedEncoder(Encoder):
    """`Encoder` whose training rows may carry embedding-layer edits (the module docstring's keys).

    `recording()` keeps the embedding output of the next forwards, (rows, width, embedding width) padded
    and differentiable (a leaf where the embeddings are frozen), for a gradient with respect to it (the
    adversarial attack)."""

    def __init__(self, backbone: str, pooler: str = "avg", with_mlm_head: bool = False, shuffles: bool = False) -> None:
        super().__init__(backbone, pooler, with_mlm_head=with_mlm_head)
        if shuffles and self.family.token_shuffle is None:
            raise UnsupportedBackbone(f"model.init_args.augmentations: shuffle reorders a sentence, which a causal "
                                      f"{self.family.model_type} reads in the order of its mask; choose another "
                                      "augmentation")
        _, width = self.family.embedding_output(self.backbone)
        self.format = EmbeddingLayerFormat(self.tokenizer, width, self.family.token_shuffle)
        self._recorded: list[Tensor] | None = None

    def run_backbone(self, features: dict[str, Tensor]) -> Any:
        input_ids = features["input_ids"]
        positions = self.family.position_ids(input_ids, features["attention_mask"])
        if "shuffle_index" in features:
            positions = positions.gather(1, features["shuffle_index"])
        if "position_shift" in features:
            positions = positions + features["position_shift"][:, None]
        with self.edited_embeddings(features):
            return self.call_backbone(features, input_ids=input_ids, position_ids=positions)

    @contextmanager
    def recording(self) -> Iterator[list[Tensor]]:
        """The embedding outputs of the forwards inside the block, in order (padded layout)."""
        self._recorded = []
        try:
            yield self._recorded
        finally:
            self._recorded = None

    @contextmanager
    def edited_embeddings(self, features: dict[str, Tensor]) -> Iterator[None]:
        """A forward hook on the embedding module for one call: replace, multiply, record its output."""
        keep, replacement, record = keep_mask(features), features.get("embedding_replacement"), self._recorded
        if keep is None and replacement is None and record is None:
            yield
            return
        packed = self.padding_free
        layout = layout_of(features) if packed else None  # a padded forward reads no layout

        def edit(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
            if replacement is not None:
                output = to_layout(replacement.to(output.dtype), layout, packed)
            if keep is not None:
                output = output * to_layout(keep, layout, packed)
            if record is not None:
                padded = layout.unpack(output[0]) if packed else output
                padded = padded if padded.requires_grad else padded.detach().requires_grad_()
                record.append(padded)
                output = to_layout(padded, layout, packed)
            return output

        module, _ = self.family.embedding_output(self.backbone)
        handle = module.register_forward_hook(edit)
        try:
            yield
        finally:
            handle.remove()


def fgv_perturbation(gradient: Tensor, norm: float) -> Tensor:
    """The Fast Gradient Value step (Rozsa et al., 2016) as ConSERT's reference takes it: each token's
    gradient scaled to L2 norm `norm` (a token without gradient, e.g. padding, gets none)."""
    return norm * gradient / (gradient.norm(dim=-1, keepdim=True) + 1e-10)
