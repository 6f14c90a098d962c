"""SBERT's classification objective (Reimers & Gurevych, 2019, §3): a softmax classifier over the
concatenation (u, v, |u - v|) of the two sentences' embeddings, trained with cross-entropy on NLI
labels, as sentence-transformers' `SoftmaxLoss` (whose three switches are these, in its order), and the
fourth of ConSERT's copy of it (`AdvCLSoftmaxLoss`): max(u, v)², element-wise."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.nli_pairs import NLI_LABELS
from ..precision import exact_fp32

__all__ = ["CONCATENATIONS", "NLISoftmaxLoss"]

# the classifier's input switches, as methods name them (sentence-transformers' names, ConSERT's fourth)
CONCATENATIONS = ("concatenation_sent_rep", "concatenation_sent_difference", "concatenation_sent_multiplication",
                  "concatenation_sent_max_square")


class NLISoftmaxLoss(nn.Module):
    """o = softmax(W_t · (u, v, |u - v|)), W_t ∈ R^{3n×k}; the loss is the mean cross-entropy.

    Args:
        embedding_dim: n, the embeddings' size.
        num_labels: k (3: entailment, neutral, contradiction).
        concatenation_sent_rep: include u and v.
        concatenation_sent_difference: include |u - v|.
        concatenation_sent_multiplication: include u * v (the paper's Table 6 ablation; off).
        concatenation_sent_max_square: include max(u, v)² (ConSERT's reference, `--concatenation_sent_max_square`,
            in all its supervised scripts; off).

    The classifier is `nn.Linear` (PyTorch's default initialization, as sentence-transformers'), run in
    fp32 with autocast off, so bf16 training keeps fp32 logits.
    """

    def __init__(self, embedding_dim: int, num_labels: int = 3, concatenation_sent_rep: bool = True,
                 concatenation_sent_difference: bool = True, concatenation_sent_multiplication: bool = False,
                 concatenation_sent_max_square: bool = False) -> None:
        super().__init__()
        self.parts = (concatenation_sent_rep, concatenation_sent_difference, concatenation_sent_multiplication,
                      concatenation_sent_max_square)
        vectors = 2 * concatenation_sent_rep + sum(self.parts[1:])
        if vectors == 0:
            raise ValueError("the classifier needs at least one of (u, v), |u - v|, u * v and max(u, v)²")
        self.classifier = nn.Linear(vectors * embedding_dim, num_labels)

    @classmethod
    def from_options(cls, embedding_dim: int, options: Mapping[str, Any]) -> NLISoftmaxLoss:
        """The NLI classifier (`NLI_LABELS`) with the `CONCATENATIONS` switches a method's hyper-parameters set."""
        return cls(embedding_dim, len(NLI_LABELS), *(options[name] for name in CONCATENATIONS))

    def logits(self, u: Tensor, v: Tensor) -> Tensor:
        """(pairs, num_labels) classifier logits in the classifier's dtype (fp32, or wider)."""
        u, v = u.to(self.classifier.weight.dtype), v.to(self.classifier.weight.dtype)
        rep, difference, multiplication, max_square = self.parts
        vectors = [u, v] if rep else []
        if difference:
            vectors.append((u - v).abs())
        if multiplication:
            vectors.append(u * v)
        if max_square:
            vectors.append(torch.maximum(u, v).pow(2))
        with exact_fp32(u.device.type):
            return self.classifier(torch.cat(vectors, dim=-1))

    def forward(self, u: Tensor, v: Tensor, labels: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss and the batch's accuracy (detached) from u, v (pairs, n) and labels (pairs,)."""
        logits = self.logits(u, v)
        accuracy = (logits.detach().argmax(-1) == labels).float().mean()
        return F.cross_entropy(logits, labels), {"accuracy": accuracy}
