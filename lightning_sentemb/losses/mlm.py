"""Token prediction: the masked-language-model auxiliary objective (SimCSE's `do_mlm`, DCPCSE's ℓ_MLM) and
what MNTP shares with it, the tokens a loss scores (`PredictedTokens`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import PreTrainedTokenizerBase

if TYPE_CHECKING:
    from ..encoders.plain import Encoder


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


class PredictedTokens:
    """The tokens a prediction loss scores, chosen on the CPU by the collator: `index`, the flat position
    (row · width + position, in the padded (batch, width) layout the encoder's forward returns, packed or
    not) of the hidden state that predicts each, and `labels`, the token it should predict. The head
    then runs on these rows only (`Encoder.mlm_logits`): about 5% of a padded 32 × 128 wiki1m batch under MNTP,
    where full-vocabulary logits at every position cost gigabytes. `host_counts` (tokens per row, on the
    host) cuts a gradient-cache chunk (`rows`) and gives the count (`count`) without a read-back. Lightning
    and the DataLoader move and pin it with the batch (`to`, `pin_memory`), as `TokenLayout`."""

    def __init__(self, index: Tensor, labels: Tensor, host_counts: list[int], width: int) -> None:
        self.index = index
        self.labels = labels
        self.host_counts = host_counts
        self.width = width

    @classmethod
    def from_labels(cls, labels: Tensor, shift: int = 0) -> PredictedTokens:
        """The tokens of (batch, width) `labels` (-100: not asked), each predicted by the state `shift`
        positions before it (0: its own, MLM; 1: the one before, MNTP's causal shift); a label with no
        state that far before it in its row is not scored."""
        width = labels.shape[1]
        asked = labels[:, shift:] != -100
        rows, positions = asked.nonzero(as_tuple=True)  # row-major, as `host_counts` counts them
        return cls(rows * width + positions, labels[:, shift:][asked], asked.sum(1).tolist(), width)

    @property
    def count(self) -> int:
        return sum(self.host_counts)

    def __getitem__(self, span: slice) -> PredictedTokens:
        return self.rows(span)

    def rows(self, span: slice) -> PredictedTokens:
        """The tokens of rows `span` alone (a gradient-cache chunk), indexed within those rows."""
        first, last, step = span.indices(len(self.host_counts))
        if step != 1:
            raise ValueError(f"predicted tokens are cut into consecutive rows, not {span}")
        start = sum(self.host_counts[:first])
        stop = start + sum(self.host_counts[first:last])
        return PredictedTokens(self.index[start:stop] - first * self.width, self.labels[start:stop],
                               self.host_counts[first:last], self.width)

    def to(self, device: torch.device | str, non_blocking: bool = True) -> PredictedTokens:
        if self.index.device == torch.device(device):
            return self
        return PredictedTokens(self.index.to(device, non_blocking=non_blocking),
                               self.labels.to(device, non_blocking=non_blocking), self.host_counts, self.width)

    def pin_memory(self) -> PredictedTokens:
        return PredictedTokens(self.index.pin_memory(), self.labels.pin_memory(), self.host_counts, self.width)


def mlm_loss(logits: Tensor, labels: Tensor, reduction: str = "mean") -> Tensor:
    """Cross-entropy over the predicted tokens (-100: not asked): their mean, or with "sum" their sum
    (gradient caching adds chunks' sums and divides by the batch's count). Only these logits are upcast
    to fp32: `Encoder.mlm_logits` computes them at the `PredictedTokens` alone."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100,
                           reduction=reduction)


def token_prediction_loss(encoder: Encoder, inputs: dict[str, Any], predicted: PredictedTokens,
                          reduction: str = "mean") -> Tensor:
    """`mlm_loss` of the `predicted` tokens, their logits from the encoder's forward on `inputs`
    (`input_ids`, `attention_mask`, `layout`) and its head at their rows alone: the MLM auxiliary loss and
    MNTP's."""
    logits = encoder.mlm_logits(inputs["input_ids"], inputs["attention_mask"], inputs.get("layout"), predicted.index)
    return mlm_loss(logits, predicted.labels, reduction)
