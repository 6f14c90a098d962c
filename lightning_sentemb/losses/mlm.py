"""Masked-language-model auxiliary objective (SimCSE's `do_mlm`, DCPCSE's ℓ_MLM)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import PreTrainedTokenizerBase


def mask_tokens(
    input_ids: Tensor,
    attention_mask: Tensor,
    tokenizer: PreTrainedTokenizerBase,
    probability: float = 0.15,
    generator: torch.Generator | None = None,
    mask_id: int | None = None,
    mask_fraction: float = 0.8,
) -> tuple[Tensor, Tensor]:
    """BERT's 80/10/10 corruption of `probability` of the real (non-special, non-pad) tokens: of those
    chosen, `mask_fraction` become `mask_id` (default the tokenizer's mask token), half the rest random
    tokens, the others stay (`mask_fraction` 1: all masked, LLM2Vec's Mistral run).

    Returns (corrupted ids, labels with -100 where no prediction is asked).
    """
    special = torch.isin(input_ids, torch.tensor(tokenizer.all_special_ids, device=input_ids.device))
    eligible = attention_mask.bool() & ~special
    chosen = (torch.rand(input_ids.shape, generator=generator) < probability) & eligible
    labels = torch.where(chosen, input_ids, torch.full_like(input_ids, -100))
    roll = torch.rand(input_ids.shape, generator=generator)
    corrupted = input_ids.clone()
    corrupted[chosen & (roll < mask_fraction)] = tokenizer.mask_token_id if mask_id is None else mask_id
    random_tokens = torch.randint(len(tokenizer), input_ids.shape, generator=generator)
    to_random = chosen & (roll >= mask_fraction) & (roll < (1 + mask_fraction) / 2)
    corrupted[to_random] = random_tokens[to_random]
    return corrupted, labels


def mlm_loss(logits: Tensor, labels: Tensor, reduction: str = "mean") -> Tensor:
    """Cross-entropy over the predicted tokens: their mean, or with "sum" their sum (gradient
    caching adds chunks' sums and divides by the batch's count)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100, reduction=reduction)
