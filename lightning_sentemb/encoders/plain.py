"""The shared encoder: a Hugging Face backbone, an input format and a pooler.

Methods differ in how they format the input (plain, discrete template, continuous prompt,
deep prefix); everything else — loading, pooling, batching for evaluation — lives here once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor, nn
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.modeling_layers import GradientCheckpointingLayer

from ..backbones import UnsupportedBackbone, family_of
from ..errors import SentEmbUserError
from .packed import SENTEMB_ATTENTION, TokenLayout, layout_of, packed_forward, set_attention
from .pretrained import load_config, load_pretrained

log = logging.getLogger(__name__)

POOLERS = ("cls", "cls_before_pooler", "last", "avg", "avg_first_last", "avg_emb_last", "avg_top2", "mask", "echo_mean",
           "echo_last")
ECHO_POOLERS = ("echo_mean", "echo_last")  # read an echo template's second copy (`encoders.echo`)
LAYER_POOLERS = ("avg_first_last", "avg_emb_last", "avg_top2")  # read hidden_states of several layers
# the state each layer pooler averages with the last layer's: `hidden_states[i]` (0 = the embedding output)
FIRST_STATE = {"avg_first_last": 1, "avg_emb_last": 0, "avg_top2": -2}


class PlainFormat:
    """`[CLS] sentence [SEP]` (or `<s> sentence </s>`): the sentence is the whole input.

    Sentences are tokenized once without special tokens (the DataModule caches these ids);
    `build` adds the special tokens, truncates the sentence and pads. Keeping the two steps
    apart lets prompt formats wrap the same cached ids in their templates.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.prefix_ids, self.suffix_ids = special_tokens_around(tokenizer)
        self.pad_id: int = tokenizer.pad_token_id

    @property
    def num_special_tokens(self) -> int:
        return len(self.prefix_ids) + len(self.suffix_ids)

    def sentence_ids(self, sentences: list[str]) -> list[list[int]]:
        """Token ids of each sentence alone (no special tokens, no truncation)."""
        return self.tokenizer(list(sentences), add_special_tokens=False)["input_ids"]

    def wrap(self, ids: list[int], max_length: int | None) -> list[int]:
        """One row: special tokens around the sentence, the sentence cut so the row fits max_length."""
        if max_length is not None:
            ids = ids[: max(max_length - self.num_special_tokens, 0)]
        return self.prefix_ids + list(ids) + self.suffix_ids

    def build(self, sentence_ids: list[list[int]], max_length: int | None) -> dict[str, Tensor]:
        """Padded `input_ids` and `attention_mask` for a list of tokenized sentences."""
        return pad_rows([self.wrap(ids, max_length) for ids in sentence_ids], self.pad_id)


def special_tokens_around(tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """(ids before, ids after) the text in what the tokenizer makes of one: `[CLS]` / `[SEP]`, `<s>` /
    `</s>`, Llama's BOS / nothing, an EOS-appending tokenizer's nothing / EOS."""
    probe = tokenizer("x", add_special_tokens=False)["input_ids"]
    full = tokenizer("x")["input_ids"]
    start = next(i for i in range(len(full) - len(probe) + 1) if full[i : i + len(probe)] == probe)
    return full[:start], full[start + len(probe) :]


def pad_ids(rows: list[list[int]], pad_value: int) -> Tensor:
    """Rows of ints right-padded with `pad_value` into one (rows, longest) tensor."""
    padded = torch.full((len(rows), max(len(r) for r in rows)), pad_value, dtype=torch.long)
    for i, row in enumerate(rows):
        padded[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return padded


def pad_rows(rows: list[list[int]], pad_id: int) -> dict[str, Any]:
    """Right-pad id rows into `input_ids` / `attention_mask` tensors, with the `layout` of their real
    tokens for the packed forward (built here, on the CPU, so the forward never counts tokens on the
    device)."""
    input_ids = pad_ids(rows, pad_id)
    lengths = torch.tensor([len(r) for r in rows])
    attention_mask = (torch.arange(input_ids.shape[1])[None] < lengths[:, None]).long()
    return {"input_ids": input_ids, "attention_mask": attention_mask, "layout": TokenLayout.from_mask(attention_mask)}


def masked_mean(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)


def last_token_positions(attention_mask: Tensor) -> Tensor:
    """(batch,) index of each row's last real token, whichever side the row is padded on."""
    width = attention_mask.shape[1]
    return width - 1 - attention_mask.flip(1).argmax(1)


def pool(pooler: str, outputs: Any, features: dict[str, Tensor]) -> Tensor:
    """Sentence vector from backbone outputs.

    `features["attention_mask"]` must cover the sentence tokens only (never a prefix-extended mask).
    `last` takes each row's last real token (left or right padding); `mask` the position the template
    format put in `features["pool_position"]` (the [MASK] token, or a decoder template's last token).
    `echo_mean` / `echo_last`: the mean / the last token of an echo template's second copy
    (`features["echo_mask"]`, `encoders.echo`).
    The layer poolers average the last layer's states with those of another (`FIRST_STATE`), then the
    tokens: `avg_first_last` the first transformer layer's (`hidden_states[1]`, BERT-whitening's and SimCSE's
    current code), `avg_emb_last` the embedding output (`hidden_states[0]`, what SimCSE's first release
    called first-last and what the seed tables' raw BERT row scored, SimCSE issue 285), `avg_top2` the
    second-to-last layer's.
    The mean poolers average over `features["pool_mask"]` where the rows carry one (queries whose
    instruction stays out of the vector, `encoders.instruction`), else over the attention mask.
    """
    attention_mask = features["attention_mask"]
    mean_mask = features.get("pool_mask", attention_mask)
    hidden = outputs.last_hidden_state
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    if pooler in ("cls", "cls_before_pooler"):
        return hidden[:, 0]
    if pooler == "last":
        return hidden[rows, last_token_positions(attention_mask)]
    if pooler == "mask":
        return hidden[rows, features["pool_position"]]
    if pooler == "avg":
        return masked_mean(hidden, mean_mask)
    if pooler == "echo_mean":
        return masked_mean(hidden, features["echo_mask"])
    if pooler == "echo_last":
        return hidden[rows, last_token_positions(features["echo_mask"])]
    if pooler in FIRST_STATE:
        states = outputs.hidden_states
        return masked_mean((states[FIRST_STATE[pooler]] + states[-1]) / 2.0, mean_mask)
    raise ValueError(f"unknown pooler {pooler!r}; choose one of {', '.join(POOLERS)}")


# from_pretrained options of the backbone weights (dtype, 4-bit quantization, dropout probabilities, the
# attention kernel of the padded forward) for
# the encoders built in `backbone_loading`: `SentEmbMethod` sets them once around `build_encoder`, so no
# method passes them on.
_BACKBONE_OPTIONS: ContextVar[dict[str, Any] | None] = ContextVar("backbone_options", default=None)
_DEFER_WEIGHTS: ContextVar[bool] = ContextVar("defer_weights", default=False)
# what `from_pretrained` takes beyond the config's own fields (which it sets on the config)
_LOADING_OPTIONS = ("dtype", "quantization_config", "device_map", "attn_implementation")


@contextmanager
def backbone_loading(defer_weights: bool = False, **options: Any) -> Iterator[None]:
    """Encoders built inside load their backbone with `from_pretrained(..., **options)`; with
    `defer_weights`, they build its skeleton on the meta device instead (the same architecture and
    config, no memory, nothing read), and `Encoder.load_backbone` loads it later."""
    tokens = _BACKBONE_OPTIONS.set(options), _DEFER_WEIGHTS.set(defer_weights)
    try:
        yield
    finally:
        _BACKBONE_OPTIONS.reset(tokens[0])
        _DEFER_WEIGHTS.reset(tokens[1])


def backbone_skeleton(auto_class: Any, name: str, options: dict[str, Any]) -> PreTrainedModel:
    """`auto_class`'s model of backbone `name` on the meta device: its config with the options' config
    fields (dropout), its dtype and attention implementation, no weights."""
    config = load_config(name)
    config.update({key: value for key, value in options.items() if key not in _LOADING_OPTIONS})
    kwargs = {key: options[key] for key in ("dtype", "attn_implementation") if key in options}
    with torch.device("meta"):
        return auto_class.from_config(config, **kwargs)


class Encoder(nn.Module):
    """Backbone + pooler. `forward(features) -> (batch, hidden)` sentence vectors.

    What the backbone's architecture decides (positions, which poolers make sense, the packed
    forward, an MLM head) is asked of its family (`self.family`, `lightning_sentemb.backbones`); a
    pooler or head the family cannot serve is refused here with `UnsupportedBackbone`.

    With `with_mlm_head` the backbone is loaded through AutoModelForMaskedLM so the checkpoint's
    MLM head is used when it has one; a checkpoint without one (e.g. all-MiniLM-L6-v2) gets a fresh
    head whose decoder is tied to the word embeddings. With `with_lm_head`, a decoder's causal-LM head
    (AutoModelForCausalLM; MNTP), served by the same `mlm_logits`: frozen when untied, trained with the
    input embeddings it is when tied. The backbone's weights load with the options of
    the enclosing `backbone_loading` (dtype, 4-bit, dropout probabilities), the tokenizer without; when it
    defers them, `load_backbone` loads them later (`SentEmbMethod.configure_model`).

    Speed switches (set by the method from `padding_free`, `attn_implementation` and `compile_layers`,
    see `configure_speed`): the padding-free forward (`encoders.packed`) is on by default wherever the
    backbone supports it, the MLM auxiliary head included; an `attn_implementation` in the loading
    options selects transformers' padded forward with that kernel instead.
    """

    # formats whose rows carry `pool_position` (templates) may pool with "mask"
    reads_templates: bool = False
    # formats whose rows carry `echo_mask` (`encoders.echo`) may pool with the echo poolers
    reads_echo: bool = False
    # a decoder's causal masking off (`set_bidirectional`)
    bidirectional: bool = False
    # the packed forward on (`set_padding_free`), else the padded one
    padding_free: bool = False

    def __init__(
        self,
        backbone: str,
        pooler: str = "cls",
        with_mlm_head: bool = False,
        with_lm_head: bool = False,
    ) -> None:
        super().__init__()
        if pooler not in POOLERS:
            raise SentEmbUserError(f"model.init_args.pooler: unknown pooler {pooler!r}; choose one of "
                                   f"{', '.join(POOLERS)}")
        if pooler == "mask" and not self.reads_templates:
            raise SentEmbUserError("model.init_args.pooler: 'mask' reads a template's mask token; plain-input methods "
                                   f"pool with one of {', '.join(p for p in POOLERS if p != 'mask')}")
        if pooler in ECHO_POOLERS and not self.reads_echo:
            raise SentEmbUserError(f"model.init_args.pooler: {pooler!r} reads an echo template's second copy: set "
                                   "model.init_args.template echo")
        self.name_or_path = backbone
        self.pooler = pooler
        family = family_of(load_config(backbone))
        refusal = (family.pooler_refusal(pooler) or (family.mlm_refusal() if with_mlm_head else None)
                   or (family.lm_refusal() if with_lm_head else None))
        if refusal is not None:
            raise UnsupportedBackbone(refusal)
        self.tokenizer = load_pretrained(AutoTokenizer, backbone)
        family.prepare_tokenizer(self.tokenizer)
        self.auto_class = AutoModelForMaskedLM if with_mlm_head else AutoModelForCausalLM if with_lm_head else AutoModel
        options = _BACKBONE_OPTIONS.get() or {}
        if _DEFER_WEIGHTS.get():
            self.set_backbone(backbone_skeleton(self.auto_class, backbone, options))
        else:
            self.set_backbone(load_pretrained(self.auto_class, backbone, **options))
        self.attn_implementation: str | None = options.get("attn_implementation")
        # the padded forward's kernel: the one asked for, else what transformers picked at loading (SDPA)
        self.padded_attention: str = self.backbone.config._attn_implementation
        self.packed_kernel = "auto"  # `encoders.packed.Kernel`; tests pick one
        self.layers_compiled = False
        self.family = family_of(self.backbone.config)
        self.format = PlainFormat(self.tokenizer)
        # on wherever supported, also for encoders built without `configure_speed` (exports)
        self.set_padding_free(self.attn_implementation is None and self.family.packed_refusal(self.backbone) is None)

    def set_backbone(self, model: PreTrainedModel) -> None:
        """Take `model` (an `auto_class` model: with the MLM head when there is one) as the backbone."""
        self.mlm_model = model if self.auto_class is not AutoModel else None
        self.backbone = model.base_model if self.mlm_model is not None else model
        head = model.get_output_embeddings() if self.auto_class is AutoModelForCausalLM else None
        if head is not None and head.weight is not model.get_input_embeddings().weight:
            head.requires_grad_(False)  # next-token prediction reads an untied head as pretrained (methods.mntp)
        # from_pretrained returns eval mode; Lightning keeps module modes, and dropout is
        # SimCSE's augmentation, so start in train mode like a freshly built module.
        self.train()
        family_of(self.backbone.config).prepare_backbone(self.backbone)
        if self.bidirectional:
            self.backbone.config.is_causal = False

    def set_bidirectional(self) -> None:
        """Every token of a decoder sees the whole sentence (LLM2Vec): `config.is_causal = False`, transformers'
        switch, which its padded masks honour, and our attention function too (`encoders.packed`: no causal
        masking, no sliding window, in every kernel). The padded forward then runs through ours
        (`SENTEMB_ATTENTION`), since transformers' SDPA would mask causally a batch without padding."""
        refusal = self.family.bidirectional_refusal(self.backbone)
        if refusal is None and self.attn_implementation is not None:
            refusal = (f"attn_implementation {self.attn_implementation!r} is transformers' own kernel; bidirectional "
                       "attention runs through lightning_sentemb's (set attn_implementation null)")
        if refusal is not None:
            raise UnsupportedBackbone(f"bidirectional: {refusal}")
        self.bidirectional = True
        self.backbone.config.is_causal = False
        self.padded_attention = SENTEMB_ATTENTION
        self.set_padding_free(self.padding_free)

    @property
    def weights_deferred(self) -> bool:
        """The backbone is still the skeleton of `backbone_loading(defer_weights=True)`."""
        return self.backbone.device.type == "meta"

    def load_backbone(self, **options: Any) -> None:
        """Replace the skeleton by the backbone's weights, `from_pretrained(..., **options)` (a `device_map`
        loads them straight onto that device); the speed switches set on the skeleton carry over."""
        padding_free = self.padding_free
        self.set_backbone(load_pretrained(self.auto_class, self.name_or_path, **options))
        self.set_padding_free(padding_free)
        if self.layers_compiled:
            self.compile_layers()

    @property
    def hidden_size(self) -> int:
        return self.backbone.config.hidden_size

    @property
    def max_length(self) -> int:
        return min(self.tokenizer.model_max_length, self.family.max_positions)

    def set_padding_free(self, padding_free: bool) -> None:
        """The packed forward (`encoders.packed`: our attention function, set once) or the padded one (with
        `padded_attention`) from the next call on."""
        self.padding_free = padding_free
        set_attention(self.backbone, SENTEMB_ATTENTION if padding_free else self.padded_attention)

    def configure_speed(self, padding_free: bool, compile_layers: bool) -> None:
        """Padding-free forward where the backbone supports it and no `attn_implementation` was asked for
        (else the padded one, with the reason logged); `compile_layers` compiles each of the backbone's
        layers (`torch.compile`, dynamic shapes, so a new batch length does not recompile)."""
        reason = None
        if padding_free and self.attn_implementation is not None:
            reason = f"attn_implementation {self.attn_implementation!r} selects transformers' padded forward"
        elif padding_free:
            reason = self.family.packed_refusal(self.backbone)
        if reason is not None:
            log.warning("padding-free forward off for %s: %s; using the padded forward", self.name_or_path, reason)
        self.set_padding_free(padding_free and reason is None)
        self.layers_compiled = compile_layers
        if compile_layers:
            self.compile_layers()

    def compile_layers(self) -> None:
        """`torch.compile` every transformers layer of the backbone (dynamic shapes)."""
        for module in self.backbone.modules():
            if isinstance(module, GradientCheckpointingLayer):
                module.compile(dynamic=True)

    def call_backbone(
        self,
        features: dict[str, Tensor],
        input_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        position_ids: Tensor | None = None,
        output_hidden_states: bool | None = None,
    ) -> Any:
        """The backbone on these rows, padding-free when switched on (same outputs at real tokens).
        Positions default to the family's numbering from each row's first token."""
        attention_mask = features["attention_mask"]
        if position_ids is None:
            position_ids = self.family.position_ids(input_ids, attention_mask)
        if output_hidden_states is None:
            output_hidden_states = self.pooler in LAYER_POOLERS
        if self.padding_free:
            return packed_forward(self.backbone, layout_of(features), input_ids, inputs_embeds, position_ids,
                                  output_hidden_states=output_hidden_states, kernel=self.packed_kernel)
        return self.backbone(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                             position_ids=position_ids, output_hidden_states=output_hidden_states)

    def run_backbone(self, features: dict[str, Tensor]) -> Any:
        """The backbone forward; input formats that inject prompts or prefixes override this."""
        return self.call_backbone(features, input_ids=features["input_ids"])

    def forward(self, features: dict[str, Tensor]) -> Tensor:
        """(sentences, hidden): the pooled state of every input row, combined by `combine_rows`."""
        rows = pool(self.pooler, self.run_backbone(features), features)
        return self.combine_rows(rows, features)

    # Feature keys that describe the whole batch rather than one row (read by `combine_rows`):
    # gradient caching slices every other key by rows.
    combine_keys: tuple[str, ...] = ()

    def combine_rows(self, row_states: Tensor, features: dict[str, Tensor]) -> Tensor:
        """Sentence vectors from the pooled states of every input row: the rows themselves here
        (formats with extra rows, e.g. template bias rows, override). `forward` on features
        without `combine_keys` gives the row states, so they can be computed in chunks."""
        return row_states

    def mlm_logits(self, input_ids: Tensor, attention_mask: Tensor, layout: TokenLayout | None,
                   index: Tensor) -> Tensor:
        """(len(index), vocab) logits of the MLM (or causal-LM) head at the flat positions `index` of the
        (batch · width) final states (`losses.mlm.PredictedTokens`): the head runs on the rows a loss reads,
        never on the full vocabulary at every position."""
        if self.mlm_model is None:
            raise RuntimeError("this encoder was built without an MLM head (with_mlm_head=False)")
        hidden = self.mlm_hidden_states(input_ids, attention_mask, layout)
        return self.family.mlm_logits(self.mlm_model, hidden.flatten(0, 1).index_select(0, index))

    def mlm_hidden_states(self, input_ids: Tensor, attention_mask: Tensor, layout: TokenLayout | None) -> Tensor:
        """(batch, width, hidden) final states the MLM head reads: the backbone's forward (packed with the
        batch's `layout` when switched on); formats that inject a prefix override this."""
        features = {"attention_mask": attention_mask, "layout": layout}
        return self.call_backbone(features, input_ids=input_ids, output_hidden_states=False).last_hidden_state
