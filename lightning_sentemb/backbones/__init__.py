"""Backbone families: what differs per architecture, one module per family (see `family`)."""

from .bert import BertFamily, RobertaFamily, RobertaPositionsEncoderFamily
from .family import BackboneFamily, DecoderFamily, EncoderFamily, UnsupportedBackbone, family_of, with_dropout
from .modernbert import ModernBertFamily

# model_type -> family with quirks; other masked / causal LMs get EncoderFamily / DecoderFamily
FAMILIES: dict[str, type[BackboneFamily]] = {
    "bert": BertFamily,
    "roberta": RobertaFamily,
    "xlm-roberta": RobertaFamily,
    "modernbert": ModernBertFamily,
    # positions counted RoBERTa's way (HF's create_position_ids_from_input_ids)
    **dict.fromkeys(["camembert", "data2vec-text", "ibert", "longformer", "luke", "mpnet", "roberta-prelayernorm",
                     "xlm-roberta-xl", "xmod"], RobertaPositionsEncoderFamily),
}

__all__ = ["FAMILIES", "BackboneFamily", "BertFamily", "DecoderFamily", "EncoderFamily", "ModernBertFamily",
           "RobertaFamily", "RobertaPositionsEncoderFamily", "UnsupportedBackbone", "family_of", "with_dropout"]
