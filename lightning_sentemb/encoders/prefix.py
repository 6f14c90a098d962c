"""Deep continuous prefix prompts (DCPCSE, P-tuning v2) on a frozen Hugging Face backbone.

Every self-attention layer of the backbone gets ``prefix_len`` extra trainable key/value
vectors that the sentence tokens attend to. The prefix never enters the hidden states, so the
backbone's outputs cover the sentence tokens only and poolers use the sentence's own attention
mask (the DCPCSE reference hands the prefix-extended mask to its mean poolers, a bug we avoid).

The prefix joins attention through our attention function (`encoders.packed.sentemb_attention`), on
the packed and the padded forward alike: the forward carries every layer's prefix
(`LayerPrefixes`), and each attention layer prepends its own to its keys and values, visible to every
token (a causal decoder's tokens see the whole prefix and, within the sentence, what precedes them; a
sliding-window layer's, the whole prefix too). Any backbone whose attention goes through
transformers' attention interface takes it, with or without a key/value cache (DistilBERT, ELECTRA,
ModernBERT), and gradient checkpointing keeps it (it rides in the forward's arguments, not a cache).

Decoders with grouped-query attention get one prefix per key/value head (``prefix_dims``).
"""

from typing import Literal

import torch
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput

from ..backbones import family_of
from .packed import SENTEMB_ATTENTION, Kernel, LayerPrefixes, TokenLayout, packed_forward, set_attention

__all__ = ["PrefixEncoder", "PrefixedBackbone", "prefix_parameter_count"]

PositionOffset = Literal["shifted", "zero"]


class PrefixEncoder(nn.Module):
    """Per-layer key/value prefixes, optionally reparameterized through a two-layer MLP.

    Layout, names and initialization follow the DCPCSE reference (its P-tuning v2 prefix
    encoder), so its checkpoints load by name: ``embedding`` holds either the prefixes
    themselves (``prefix_len x num_layers*2*kv_size``) or, with ``projection``, ``prefix_len x hidden``
    inputs to ``trans`` = Linear(hidden, projection_hidden) -> Tanh -> Linear(projection_hidden,
    num_layers*2*kv_size). Each row of the output reads [layer0 key, layer0 value, layer1 key, ...],
    each a ``kv_size = kv_heads * head_dim`` vector split into heads (``kv_size`` is ``hidden`` for
    BERT). The reference re-initializes these modules with the backbone's ``_init_weights``
    (normal(0, initializer_range), zero biases), hence ``init_std``. Dropout is applied to the final
    prefixes, independently for every example of the batch.
    """

    def __init__(
        self,
        prefix_len: int,
        num_layers: int,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        projection: bool = False,
        projection_hidden_size: int = 512,
        dropout: float = 0.1,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.prefix_len = prefix_len
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.head_dim = head_dim
        output_size = num_layers * 2 * num_heads * head_dim
        if projection:
            self.embedding = nn.Embedding(prefix_len, hidden_size)
            self.trans: nn.Sequential | None = nn.Sequential(
                nn.Linear(hidden_size, projection_hidden_size),
                nn.Tanh(),
                nn.Linear(projection_hidden_size, output_size),
            )
        else:
            self.embedding = nn.Embedding(prefix_len, output_size)
            self.trans = None
        self.dropout = nn.Dropout(dropout)
        for module in self.modules():
            if isinstance(module, (nn.Embedding, nn.Linear)):
                nn.init.normal_(module.weight, mean=0.0, std=init_std)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    @classmethod
    def from_config(
        cls,
        config: PreTrainedConfig,
        prefix_len: int,
        projection: bool = False,
        projection_hidden_size: int = 512,
        dropout: float | None = None,
    ) -> "PrefixEncoder":
        """Sizes from the backbone's config through its family (key/value heads and head size);
        dropout defaults to ``hidden_dropout_prob`` as in the reference (0 where a config has none)."""
        layers, kv_heads, head_dim = family_of(config).prefix_dims()
        default_dropout = getattr(config, "hidden_dropout_prob", 0.0)
        return cls(
            prefix_len=prefix_len,
            num_layers=layers,
            hidden_size=config.hidden_size,
            num_heads=kv_heads,
            projection=projection,
            projection_hidden_size=projection_hidden_size,
            dropout=default_dropout if dropout is None else dropout,
            init_std=getattr(config, "initializer_range", 0.02),
            head_dim=head_dim,
        )

    def forward(self, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One (key, value) pair per layer, each of shape (batch, heads, prefix_len, head_dim)."""
        prefix = self.embedding.weight
        if self.trans is not None:
            prefix = self.trans(prefix)
        prefix = prefix.view(1, self.prefix_len, 2 * self.num_layers, self.num_heads, self.head_dim)
        prefix = self.dropout(prefix.expand(batch_size, -1, -1, -1, -1))
        prefix = prefix.permute(2, 0, 3, 1, 4)  # (2 * layers, batch, heads, prefix_len, head_dim)
        return [(prefix[2 * layer], prefix[2 * layer + 1]) for layer in range(self.num_layers)]


class PrefixedBackbone(nn.Module):
    """A frozen backbone whose every attention layer attends to trainable prefixes.

    Only ``prefix_encoder`` is trainable. The backbone's train/eval mode is left to the caller:
    during training it stays in train mode because dropout is DCPCSE's augmentation.

    ``position_offset`` decides where the sentence's position ids start:

    - ``"shifted"`` (default, the reference's and therefore the paper's behaviour): the prefix counts
      as past tokens, so BERT positions run ``prefix_len .. prefix_len+L-1``, RoBERTa's
      ``padding_idx+1+prefix_len ..`` (pads keep ``padding_idx``) and a rotary model's from
      ``prefix_len``. transformers 4.2.1, used by the reference, already shifted BERT and RoBERTa by
      the past length, and 5.x still does, as every decoder does after a cache.
    - ``"zero"``: positions as without a prefix (BERT ``0 .. L-1``, RoBERTa ``padding_idx+1 ..``,
      rotary ``0 ..``): sentences keep the positions they had in pretraining and the whole
      ``max_position_embeddings`` stays usable.

    Positions are passed explicitly on both paths (the family's numbering from each row's first token).
    ``forward`` returns the backbone's outputs, covering the sentence tokens only. The backbone runs
    packed when its attention is set to the packed function (`Encoder.configure_speed`), else padded
    through ours (SDPA with the prefix), which this sets.
    """

    def __init__(
        self,
        backbone: PreTrainedModel,
        prefix_len: int,
        projection: bool = False,
        projection_hidden_size: int = 512,
        dropout: float | None = None,
        position_offset: PositionOffset = "shifted",
    ) -> None:
        super().__init__()
        if position_offset not in ("shifted", "zero"):
            raise ValueError(f"position_offset must be 'shifted' or 'zero', got {position_offset!r}")
        self.backbone = backbone
        self.family = family_of(backbone.config)
        self.backbone.requires_grad_(False)
        self.prefix_len = prefix_len
        self.position_offset = position_offset
        set_attention(backbone, SENTEMB_ATTENTION)  # the prefix joins the keys in our attention function
        self.layer_of: dict[nn.Module, int] = {}  # attention module -> layer (`LayerPrefixes`)
        self.prefix_encoder = PrefixEncoder.from_config(backbone.config, prefix_len, projection, projection_hidden_size,
                                                        dropout)

    @property
    def max_sentence_length(self) -> int:
        """Longest input (in tokens) the position embeddings allow; truncate tokenization to it."""
        shift = self.prefix_len if self.position_offset == "shifted" else 0
        return self.family.max_positions - shift

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        layout: TokenLayout | None = None,
        kernel: Kernel = "auto",
    ) -> BaseModelOutput:
        """Run the backbone with the prefix: packed with the batch's ``layout`` (and the attention ``kernel``)
        when given, else on the padded batch."""
        batch_size, seq_len = input_ids.shape
        if seq_len > self.max_sentence_length:
            raise ValueError(
                f"input length {seq_len} exceeds max_sentence_length {self.max_sentence_length} "
                f"(position_offset={self.position_offset!r}, prefix_len={self.prefix_len})"
            )
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        prefix = LayerPrefixes(self.prefix_encoder(batch_size), self.layer_of)
        past = self.prefix_len if self.position_offset == "shifted" else 0
        position_ids = self.family.position_ids(input_ids, attention_mask, past)
        if layout is not None:
            return packed_forward(self.backbone, layout.to(input_ids.device), input_ids, position_ids=position_ids,
                                  prefix=prefix, output_hidden_states=output_hidden_states, kernel=kernel)
        return self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             output_hidden_states=output_hidden_states, use_cache=False, sentemb_prefix=prefix)


def prefix_parameter_count(
    config: PreTrainedConfig,
    prefix_len: int,
    projection: bool = False,
    projection_hidden_size: int = 512,
) -> int:
    """Trainable parameters of a ``PrefixEncoder`` for ``config``, from the config alone."""
    layers, kv_heads, head_dim = family_of(config).prefix_dims()
    hidden = config.hidden_size
    output_size = layers * 2 * kv_heads * head_dim
    if not projection:
        return prefix_len * output_size
    embedding = prefix_len * hidden
    first_linear = hidden * projection_hidden_size + projection_hidden_size
    second_linear = projection_hidden_size * output_size + output_size
    return embedding + first_linear + second_linear
