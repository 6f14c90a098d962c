"""ModernBERT: rotary positions, global attention every few layers and a bidirectional sliding window in
the others (the packed forward passes the window to our attention function, `encoders.packed`), its
own dropout names and masked-LM head."""

from __future__ import annotations

from torch import Tensor
from transformers import PreTrainedModel

from .family import BackboneFamily


class ModernBertFamily(BackboneFamily):
    name = "modernbert"
    dropout_keys = ("attention_dropout", "embedding_dropout", "mlp_dropout")

    def mlm_logits(self, mlm_model: PreTrainedModel, hidden: Tensor) -> Tensor:
        """ModernBertForMaskedLM's head: prediction head, then the (tied) decoder."""
        return mlm_model.decoder(mlm_model.head(hidden))
