"""Masked next-token prediction (LLM2Vec's MNTP): a masked token is predicted from the output one
position before it, through the causal LM's own head, so a decoder made bidirectional keeps reading its
pretrained head the way it was trained (the state at i − 1 predicts token i)."""

from __future__ import annotations

from torch import Tensor

from .mlm import mlm_loss


def next_token_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy of `labels[:, i]` (-100: not asked) against `logits[:, i - 1]`: a causal LM's
    loss shift, over the masked tokens only. A label at a row's first position has no state before it
    and is not scored."""
    return mlm_loss(logits[:, :-1], labels[:, 1:])
