"""What differs per backbone architecture, in one place per family.

A `BackboneFamily` answers what the encoders and methods ask of an architecture: which poolers make
sense, how positions are numbered, where a template is read, whether a masked-LM head exists, the
shape of a DCPCSE prefix, and whether the padding-free forward and deep prefixes can run (both go
through transformers' attention interface, `encoders.packed`: no family holds a forward of its own).
`EncoderFamily` / `DecoderFamily` are what any masked / causal LM `AutoModel` gets; `bert` and
`modernbert` add their quirks. `family_of(config)` picks one; nothing outside this package asks what
architecture a model is.

A method × backbone pair that cannot work is refused at construction with `UnsupportedBackbone`
(one line; the method adds its own name).
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar, Literal

from torch import Tensor, nn
from transformers import PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from ..errors import SentEmbUserError

TemplateReadout = Literal["mask", "last"]
TokenShuffle = Literal["positions", "tokens"]


class UnsupportedBackbone(SentEmbUserError):
    """A method × backbone pair that cannot work; the message says why (the method names itself)."""


class BackboneFamily:
    """A bidirectional encoder evaluated through the backbone's own padded forward.

    Subclasses override what differs; every method here has the encoder default.
    """

    name: ClassVar[str] = "encoder"
    causal: ClassVar[bool] = False
    default_pooler: ClassVar[str] = "cls"
    # Where a template is read: "mask" (the [MASK] token's state, PromptBERT) or "last" (the state of
    # the template's last token, which a causal model uses to predict the word that follows: PromptEOL).
    template_readout: ClassVar[TemplateReadout] = "mask"
    # Config fields of the backbone's dropout probabilities (`model.init_args.dropout` sets those the
    # config has).
    dropout_keys: ClassVar[tuple[str, ...]] = ("hidden_dropout_prob", "attention_probs_dropout_prob")
    # How ConSERT's token shuffling reorders a sentence (`methods.consert`): "positions" permutes its position
    # ids (the paper's way, for learned absolute positions), "tokens" permutes the tokens themselves (the same
    # augmentation for a bidirectional encoder whose positions are relative, rotary or read elsewhere, e.g.
    # ModernBERT's windows, which follow the token order), None: refused.
    token_shuffle: ClassVar[TokenShuffle | None] = "tokens"

    def __init__(self, config: PreTrainedConfig) -> None:
        self.config = config

    @property
    def model_type(self) -> str:
        return self.config.model_type

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.model_type!r})"

    # ----- loading -------------------------------------------------------------------------
    def prepare_tokenizer(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """Fix what the methods need of the tokenizer in place (a pad token; right padding)."""
        if tokenizer.pad_token_id is None:
            if tokenizer.eos_token is None:
                raise UnsupportedBackbone(f"the {self.model_type} tokenizer has neither a pad nor an eos token "
                                          "to pad with")
            tokenizer.pad_token = tokenizer.eos_token  # padding is masked: any id serves
        tokenizer.padding_side = "right"

    def unread_modules(self, backbone: PreTrainedModel) -> list[str]:
        """Names of the backbone's modules that none of our poolers reads: an encoder's own pooler
        (Linear+Tanh over [CLS]). They are frozen and get no LoRA adapter, else DDP stops on parameters
        without a gradient; kept, not dropped: `load_method(pooler="cls")` and the export use them."""
        return ["pooler"] if getattr(backbone, "pooler", None) is not None else []

    def prepare_backbone(self, backbone: PreTrainedModel) -> None:
        for name in self.unread_modules(backbone):
            backbone.get_submodule(name).requires_grad_(False)

    # ----- what a method may ask for -------------------------------------------------------
    def pooler_refusal(self, pooler: str) -> str | None:
        return None

    def mlm_refusal(self) -> str | None:
        return None

    def lm_refusal(self) -> str | None:
        """Why the causal-LM head (next-token prediction, MNTP) is not there, or None."""
        if not self.causal:
            return f"next-token prediction reads a causal LM's head and {self.model_type} is an encoder"
        return None

    def bidirectional_refusal(self, backbone: PreTrainedModel) -> str | None:
        """Why causal masking cannot be switched off (`bidirectional: true`; it goes through the attention
        interface, `encoders.packed`), or None when it can."""
        if not self.causal:
            return f"{self.model_type} is an encoder, bidirectional already: remove model.init_args.bidirectional"
        if not backbone._supports_attention_backend:
            return f"{self.model_type} does not route attention through transformers' attention interface"
        return None

    def template_refusal(self, tokenizer: PreTrainedTokenizerBase) -> str | None:
        if self.template_readout == "mask" and tokenizer.mask_token_id is None:
            return f"prompt templates are read at the mask token and the {self.model_type} tokenizer has none"
        return None

    def prefix_refusal(self, backbone: PreTrainedModel) -> str | None:
        """Why DCPCSE's prefix cannot join this backbone's attention (it goes through the attention
        interface, packed or padded), or None when it can."""
        if not backbone._supports_attention_backend:
            return (f"deep prefixes join attention through transformers' attention interface, which "
                    f"{self.model_type} does not use")
        return None

    def packed_refusal(self, backbone: PreTrainedModel) -> str | None:
        """Why the packed forward (`encoders.packed`: the model's own forward on one row of real tokens)
        cannot run this backbone, or None when it can."""
        if not backbone._supports_attention_backend:
            return f"{type(backbone).__name__} does not route attention through transformers' attention interface"
        if "position_ids" not in inspect.signature(backbone.forward).parameters:
            return f"{type(backbone).__name__} takes no position_ids"
        return None

    def embedding_output(self, backbone: PreTrainedModel) -> tuple[nn.Module, int]:
        """The module whose output is the embedding layer's (what the first transformer layer reads) and
        that output's width: where ConSERT's cutoffs, dropout and adversarial perturbation act. An
        encoder's `embeddings` (words, positions, token types, norm, dropout)."""
        embeddings = getattr(backbone, "embeddings", None)
        if not isinstance(embeddings, nn.Module):
            raise UnsupportedBackbone(f"augmentations act on the embedding layer's output and "
                                      f"{type(backbone).__name__} has no `embeddings` module")
        return embeddings, getattr(self.config, "embedding_size", None) or self.config.hidden_size

    # ----- positions -----------------------------------------------------------------------
    def first_position(self) -> int:
        """The position id of a sequence's first token."""
        return 0

    @property
    def max_positions(self) -> int:
        """Positions the model can number from `first_position` on."""
        return self.config.max_position_embeddings - self.first_position()

    def position_ids(self, input_ids: Tensor | None, attention_mask: Tensor, past_length: int = 0) -> Tensor:
        """(batch, width) position ids of a padded batch after `past_length` cached tokens: counted from
        each row's first real token, so left- and right-padded rows get the same positions."""
        return (attention_mask.long().cumsum(1) - 1).clamp_min(0) + self.first_position() + past_length

    # ----- MLM head ------------------------------------------------------------------------
    def mlm_logits(self, mlm_model: PreTrainedModel, hidden: Tensor) -> Tensor:
        """The masked-LM head of `mlm_model` over final hidden states (the DCPCSE prefix path)."""
        (head,) = [module for name, module in mlm_model.named_children() if name != mlm_model.base_model_prefix]
        return head(hidden)

    # ----- deep prefixes -------------------------------------------------------------------
    def prefix_dims(self) -> tuple[int, int, int]:
        """(layers, key/value heads, head dim) of one layer's prefix keys and values."""
        config = self.config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return config.num_hidden_layers, kv_heads, head_dim


class EncoderFamily(BackboneFamily):
    """Any other masked-LM encoder: the padded forward, poolers and [MASK] templates; no prefix."""


class DecoderFamily(BackboneFamily):
    """A causal LM (`AutoModel` of a `...ForCausalLM`): each token sees itself and what precedes it.

    Pooling: `last` by default, the last real token (the only one that has seen the whole sentence;
    PromptEOL); `avg` is mask-aware. `cls` pools the first token, which sees only itself: refused.
    Rows are what the tokenizer makes of a sentence: its own special tokens (e.g. Llama's BOS) and no
    EOS appended by us, as sentence-transformers' last-token pooling (a tokenizer that appends an EOS,
    e.g. Qwen3-Embedding's, is pooled at it). A tokenizer without a pad token pads with its EOS.

    Templates are read at their last token (PromptEOL: `This sentence : "[X]" means in one word:"`); a
    template written with [MASK] (PromptBERT's, ConPVP's) is cut just before it, the state that
    predicts the masked word. No masked-LM head: the MLM auxiliary loss is refused.
    """

    name = "decoder"
    causal = True
    default_pooler = "last"
    template_readout = "last"
    # Llama-shaped: attention_dropout; OPT: dropout too; GPT-2, Phi-3: *_pdrop
    dropout_keys = ("attention_dropout", "dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop")
    token_shuffle = None  # the causal mask follows the token order: shuffled positions contradict it

    def embedding_output(self, backbone: PreTrainedModel) -> tuple[nn.Module, int]:
        """The token embeddings (positions are rotary or added inside the model's forward)."""
        embeddings = backbone.get_input_embeddings()
        return embeddings, embeddings.embedding_dim

    def pooler_refusal(self, pooler: str) -> str | None:
        if pooler in ("cls", "cls_before_pooler"):
            return (f"pooler {pooler!r} reads the first token, which in a causal model sees only itself; "
                    "use pooler last or avg")
        return None

    def mlm_refusal(self) -> str | None:
        return f"a causal LM ({self.model_type}) has no masked-LM head: set mlm_weight 0"


def family_of(config: PreTrainedConfig) -> BackboneFamily:
    """The family of a backbone config: a known one, else the generic encoder (masked LMs) or decoder
    (causal LMs); anything else is refused."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    from . import FAMILIES

    family = FAMILIES.get(config.model_type)
    if family is None:
        if config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
            family = EncoderFamily
        elif config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            family = DecoderFamily
        else:
            raise UnsupportedBackbone(f"model type {config.model_type!r} is neither a masked LM encoder "
                                      "nor a causal LM")
    return family(config)


def with_dropout(config_kwargs: dict[str, Any], family: BackboneFamily, dropout: float | None) -> dict[str, Any]:
    """`from_pretrained` keyword arguments with every dropout of the family set to `dropout` (None: as
    the checkpoint's config says)."""
    if dropout is None:
        return config_kwargs
    if not 0 <= dropout < 1:
        raise SentEmbUserError(f"model.init_args.dropout must be in [0, 1) or null, got {dropout}")
    keys = [key for key in family.dropout_keys if hasattr(family.config, key)]
    if not keys:
        raise SentEmbUserError(f"model.init_args.dropout: no known dropout setting in the {family.model_type} config "
                               "(set its dropout fields in the checkpoint's config.json, or leave dropout null)")
    return {**config_kwargs, **{key: dropout for key in keys}}

