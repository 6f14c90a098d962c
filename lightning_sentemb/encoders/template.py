"""Prompt input formats: discrete templates (PromptBERT), continuous prompt slots (ConPVP), continuous
templates (SCPCSE), and template denoising.

A template is text with one `[X]` (the sentence), one `[MASK]` (the tokenizer's mask token; RoBERTa's
`<mask>` may be written as is) and optionally `[P]` slots, each a learnable vector in the
input-embedding space. A continuous template (`continuous`, SCPCSE: the shallow continuous prompt of
Jiang & Wang, 2022, §3.3) makes every token of its text such a vector, initialized from that token's
input embedding, at that token's position (special tokens and the mask stay as they are).

The sentence embedding is the last hidden state at the mask token — on a
causal decoder, at the template's last token: PromptEOL's `This sentence : "[X]" means in one word:"`
needs no [MASK], and a template written with one is cut just before it (the state that predicts the
masked word).

Tokenization: the text around `[X]` and `[P]` is tokenized on its own, as the tokenizer would
tokenize it inside the full string (whitespace-only pieces are dropped). The sentence comes from the
cached ids tokenized without special tokens, i.e. as if it began the text: with byte-level BPE
(RoBERTa) write the sentence glued to the text before it (`'[X]'`, not `' [X] '`), so its first word
is tokenized the same way inside the template.

Denoising (PromptBERT §5): the read state of the template with an empty sentence, whose
post-sentence position ids are shifted by the sentence's token length, is subtracted — one bias per
(template, length). The bias rows ride in the same forward pass as the sentences. Position ids are
those the backbone itself would give the full row (BERT counts from 0, RoBERTa-style embeddings from
`padding_idx + 1`); the PromptBERT reference passes positions from 0 to RoBERTa as well, an offset
of two we do not copy.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..backbones import UnsupportedBackbone
from ..backbones.family import TemplateReadout
from ..errors import SentEmbUserError
from .plain import Encoder, PlainFormat, pad_ids, pad_rows

MARKERS = re.compile(r"(\[X\]|\[P\])")


@dataclass(frozen=True)
class Template:
    """Token ids before and after the sentence (special tokens included), for each of those tokens its
    prompt slot (-1 for an ordinary token), and where the embedding is read: index `readout` of the
    prefix (`readout_in_prefix`) or of the suffix, or the row's last token (`readout` None)."""

    text: str
    prefix: list[int]
    suffix: list[int]
    prefix_slots: list[int]
    suffix_slots: list[int]
    readout: int | None
    readout_in_prefix: bool = False

    def __len__(self) -> int:
        return len(self.prefix) + len(self.suffix)

    def readout_position(self, sentence_length: int) -> int:
        """Position of the read token in a row holding a sentence of this many tokens."""
        if self.readout is None:
            return len(self) + sentence_length - 1
        return self.readout if self.readout_in_prefix else len(self.prefix) + sentence_length + self.readout


class TemplateFormat(PlainFormat):
    """Sentences wrapped in templates, with explicit position ids, the position of the read token
    (`pool_position`) and, when denoising, bias rows.

    `readout` is the backbone family's: "mask" reads the mask token's state (encoders, PromptBERT);
    "last" reads the template's last token (causal decoders, PromptEOL): a template written with
    [MASK] is cut just before it, and the tokenizer's closing special tokens are left out (a causal
    model's state at the read token cannot see them anyway).

    The template is never truncated, only the sentence. `num_special_tokens` is 0: the DataModule's
    `max_seq_len` is the sentence's own budget and the template (special tokens included) comes on
    top, as in the PromptBERT reference (which cuts the sentence to max_seq_length tokens).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, templates: Sequence[str], first_position: int = 0,
                 readout: TemplateReadout = "mask", continuous: bool = False) -> None:
        super().__init__(tokenizer)
        self.continuous = continuous
        if readout == "mask" and tokenizer.mask_token_id is None:
            raise ValueError("templates read at the mask token need a tokenizer with a mask token")
        self.readout = readout
        self.mask_id: int | None = tokenizer.mask_token_id
        # what [P] slots (and, read at the mask, mask tokens inside a sentence) are written as
        self.placeholder_id: int = tokenizer.unk_token_id if tokenizer.unk_token_id is not None else self.pad_id
        self.first_position = first_position
        self.templates = [self.parse(text) for text in templates]
        if not self.templates:
            raise SentEmbUserError("model.init_args: give at least one template")
        self.num_prompt_slots = max(max(t.prefix_slots + t.suffix_slots, default=-1) + 1 for t in self.templates)
        # continuous: the token each prompt vector starts from (a [P] slot: the placeholder token)
        self.slot_tokens: list[int] = []
        if continuous:
            if len(self.templates) != 1 or not self.num_prompt_slots:
                raise SentEmbUserError(f"model.init_args.templates: a continuous template is one template with text "
                                       f"around [X] (its tokens are the prompt vectors); got {list(templates)}")
            t = self.templates[0]
            slots = dict(zip(t.prefix_slots + t.suffix_slots, t.prefix + t.suffix, strict=True))
            self.slot_tokens = [slots[slot] for slot in range(self.num_prompt_slots)]

    @property
    def num_special_tokens(self) -> int:
        return 0

    def parse(self, text: str) -> Template:
        """Token ids of a template string; `[P]` slots hold the placeholder token."""
        if self.readout == "last":
            before, mask, after = text.partition("[MASK]")
            if mask and "[X]" not in before:
                raise SentEmbUserError(f"model.init_args: template {text!r}: a causal model reads the token "
                                       "before [MASK], so [X] must come first")
            pieces = MARKERS.split(before)
        else:
            pieces = MARKERS.split(text.replace("[MASK]", self.tokenizer.mask_token))
        if pieces.count("[X]") != 1:
            raise SentEmbUserError(f"model.init_args: template {text!r} must contain [X] exactly once")
        parts: list[tuple[list[int], list[int]]] = [(list(self.prefix_ids), [-1] * len(self.prefix_ids)), ([], [])]
        side, slot = 0, 0
        for piece in pieces:
            ids, slots = parts[side]
            if piece == "[X]":
                side = 1
            elif piece == "[P]":
                ids.append(self.placeholder_id)
                slots.append(slot)
                slot += 1
            elif piece.strip():
                tokens = self.tokenizer(piece, add_special_tokens=False)["input_ids"]
                ids.extend(tokens)
                for token in tokens:  # continuous: every token but the mask is a prompt vector
                    prompt = self.continuous and token != self.mask_id
                    slots.append(slot if prompt else -1)
                    slot += prompt
        (prefix, prefix_slots), (suffix, suffix_slots) = parts
        if self.readout == "last":
            return Template(text, prefix, suffix, prefix_slots, suffix_slots, readout=None)
        suffix.extend(self.suffix_ids)
        suffix_slots.extend([-1] * len(self.suffix_ids))
        if (prefix + suffix).count(self.mask_id) != 1:
            raise SentEmbUserError(f"model.init_args: template {text!r} must contain the mask token exactly once")
        if self.mask_id in prefix:
            return Template(text, prefix, suffix, prefix_slots, suffix_slots, prefix.index(self.mask_id), True)
        return Template(text, prefix, suffix, prefix_slots, suffix_slots, suffix.index(self.mask_id))

    def sentence_part(self, ids: list[int], max_length: int | None, template: Template) -> list[int]:
        """The sentence cut so the row fits max_length; read at the mask, mask tokens inside it become the
        placeholder token, so every row has exactly one mask."""
        if max_length is not None:
            ids = ids[: max(max_length - len(template), 0)]
        if self.readout == "mask":
            return [self.placeholder_id if i == self.mask_id else i for i in ids]
        return list(ids)

    def wrap(self, ids: list[int], max_length: int | None, template: int = 0) -> list[int]:
        """One row: the sentence inside template `template`."""
        t = self.templates[template]
        return t.prefix + self.sentence_part(ids, max_length, t) + t.suffix

    def build(
        self,
        sentence_ids: list[list[int]],
        max_length: int | None,
        templates: Sequence[int] | None = None,
        denoise: bool = False,
    ) -> dict[str, Any]:
        """Padded model inputs: `input_ids`, `attention_mask`, `layout`, `position_ids`,
        `pool_position`, `prompt_slots` (when a template has [P] slots) and, with `denoise`,
        `bias_index`.

        `templates[i]` is the template index of row i (default 0). With `denoise`, one bias row per
        distinct (template, sentence length) follows the sentence rows, and `bias_index[i]` is the
        bias row of sentence i, counted from the first bias row.
        """
        templates = [0] * len(sentence_ids) if templates is None else list(templates)
        rows, slots, positions, read, index = [], [], [], [], []
        bias_rows: dict[tuple[int, int], int] = {}
        first = self.first_position
        for ids, which in zip(sentence_ids, templates, strict=True):
            t = self.templates[which]
            sentence = self.sentence_part(ids, max_length, t)
            rows.append(t.prefix + sentence + t.suffix)
            slots.append(t.prefix_slots + [-1] * len(sentence) + t.suffix_slots)
            positions.append(list(range(first, first + len(rows[-1]))))
            read.append(t.readout_position(len(sentence)))
            if denoise:
                index.append(bias_rows.setdefault((which, len(sentence)), len(bias_rows)))
        for which, length in bias_rows:
            t = self.templates[which]
            rows.append(t.prefix + t.suffix)
            slots.append(t.prefix_slots + t.suffix_slots)
            after = first + len(t.prefix) + length
            positions.append(list(range(first, first + len(t.prefix))) + list(range(after, after + len(t.suffix))))
            read.append(t.readout_position(0))
        features = pad_rows(rows, self.pad_id)
        features["position_ids"] = pad_ids(positions, 0)
        features["pool_position"] = torch.tensor(read, dtype=torch.long)
        if self.num_prompt_slots:
            features["prompt_slots"] = pad_ids(slots, -1)
        if denoise:
            features["bias_index"] = torch.tensor(index, dtype=torch.long)
        return features


PromptInit = Literal["uniform", "normal"]


class TemplateEncoder(Encoder):
    """Backbone whose sentence vector is the (optionally denoised) state of a template's read token:
    the [MASK] on encoders, the template's last token on decoders (see `TemplateFormat`).

    Templates with `[P]` slots get `prompt`, one learnable input-embedding vector per slot number
    (shared by every template), initialized by `prompt_init`: "uniform" U[0, 1) (the ConPVP
    reference's `torch.rand`; row norm ≈ sqrt(hidden / 3), ≈ 16 at 768) or "normal" like the
    backbone's embeddings (std `initializer_range`). A `continuous` template's prompt vectors start as
    its tokens' input embeddings instead (`TemplateFormat`; set once the backbone's weights are there).

    `freeze_backbone`: only what the encoder adds trains (the prompt vectors; SCPCSE). The backbone stays
    in train mode, so dropout still makes two views differ. The deep prefix of DCPCSE is a different
    mechanism, keys and values in every attention layer (`encoders.prefix`); this one writes the prompt
    into the input sequence at the template's positions.
    """

    combine_keys = ("bias_index",)
    reads_templates = True

    def __init__(self, backbone: str, templates: Sequence[str], prompt_init: PromptInit = "uniform",
                 continuous: bool = False, freeze_backbone: bool = False) -> None:
        self.freeze_backbone = freeze_backbone  # read by `set_backbone`, which the parent's __init__ calls
        super().__init__(backbone, pooler="mask")
        refusal = self.family.template_refusal(self.tokenizer)
        if refusal is not None:
            raise UnsupportedBackbone(refusal)
        self.format = TemplateFormat(self.tokenizer, templates, self.family.first_position(),
                                     self.family.template_readout, continuous)
        self.prompt: nn.Parameter | None = None
        if self.format.num_prompt_slots:
            # input-embedding vectors: their size, not the hidden one (ELECTRA-small: 128 vs 256)
            shape = (self.format.num_prompt_slots, self.backbone.get_input_embeddings().embedding_dim)
            if prompt_init == "uniform":
                initial = torch.rand(shape)
            elif prompt_init == "normal":
                initial = torch.randn(shape) * self.backbone.config.initializer_range
            else:
                raise SentEmbUserError("model.init_args.prompt_init must be 'uniform' or 'normal', "
                                       f"got {prompt_init!r}")
            self.prompt = nn.Parameter(initial)
            if not self.weights_deferred:
                self.init_continuous_prompt()

    def set_backbone(self, model: PreTrainedModel) -> None:
        """The backbone, frozen where asked (the skeleton and the loaded weights alike)."""
        super().set_backbone(model.requires_grad_(False) if self.freeze_backbone else model)

    def load_backbone(self, **options: Any) -> None:
        super().load_backbone(**options)
        self.init_continuous_prompt()

    @torch.no_grad()
    def init_continuous_prompt(self) -> None:
        """A continuous template's prompt vectors as its tokens' input embeddings (what the embedding layer
        gives them, scaled where a family scales it)."""
        if self.format.continuous:
            embeddings = self.backbone.get_input_embeddings()
            ids = torch.tensor(self.format.slot_tokens, device=embeddings.weight.device)
            self.prompt.copy_(embeddings(ids).to(self.prompt.device, self.prompt.dtype))

    def run_backbone(self, features: dict[str, Tensor]) -> Any:
        if self.prompt is None:
            return self.call_backbone(features, input_ids=features["input_ids"], position_ids=features["position_ids"])
        embeddings = self.backbone.get_input_embeddings()(features["input_ids"])
        slots = features["prompt_slots"]
        # an embedding lookup, not `prompt[index]`: CPU indexing sums its gradient with racing atomic adds
        # past 32,768 elements, and two identical runs drift apart (issue 46)
        prompt = F.embedding(slots.clamp_min(0), self.prompt.to(embeddings.dtype))
        inputs_embeds = torch.where((slots >= 0).unsqueeze(-1), prompt, embeddings)
        return self.call_backbone(features, inputs_embeds=inputs_embeds, position_ids=features["position_ids"])

    def combine_rows(self, row_states: Tensor, features: dict[str, Tensor]) -> Tensor:
        """(sentences, hidden): the read state of each sentence row, minus its bias row's when the
        features carry `bias_index`."""
        if "bias_index" not in features:
            return row_states
        index = features["bias_index"]
        return row_states[: index.numel()] - row_states[index.numel() :][index]
