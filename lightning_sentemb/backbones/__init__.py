"""Backbone families: what differs per architecture, one module per family (see `family`)."""

from .bert import BertFamily, RobertaFamily
from .decoder import LlamaFamily, Qwen3Family
from .family import BackboneFamily, DecoderFamily, EncoderFamily, UnsupportedBackbone, family_of, with_dropout
from .modernbert import ModernBertFamily

# model_type -> family with a packed forward; other masked / causal LMs get EncoderFamily / DecoderFamily
FAMILIES: dict[str, type[BackboneFamily]] = {
    "bert": BertFamily,
    "roberta": RobertaFamily,
    "xlm-roberta": RobertaFamily,
    "modernbert": ModernBertFamily,
    "llama": LlamaFamily,
    "mistral": LlamaFamily,
    "qwen2": LlamaFamily,
    "gemma": LlamaFamily,
    "qwen3": Qwen3Family,
}

__all__ = ["FAMILIES", "BackboneFamily", "BertFamily", "DecoderFamily", "EncoderFamily", "LlamaFamily",
           "ModernBertFamily", "Qwen3Family", "RobertaFamily", "UnsupportedBackbone", "family_of", "with_dropout"]
