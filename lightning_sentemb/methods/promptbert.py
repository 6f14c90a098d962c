"""PromptBERT (Jiang et al., 2022): the [MASK] state of a template as the sentence embedding; on a
causal decoder, PromptEOL (Jiang et al., 2023): the state of the template's last token.

Unsupervised: two views of each sentence, one under each of two templates (plus dropout), InfoNCE
with in-batch negatives; supervised: NLI triplets under one template. Template denoising is switched
separately for training, validation and test.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from torch import Tensor

from ..backbones import BackboneFamily
from ..data.corpus import nli_columns
from ..encoders.template import TemplateEncoder
from ..errors import SentEmbUserError
from .collator import Collator
from .simcse import SimCSE

BERT_TEMPLATES = ('This sentence : "[X]" means [MASK] .', 'This sentence of "[X]" means [MASK] .')
# RoBERTa: written so the rows are the reference's token for token (`<s> This Ġsentence Ġ: Ġ'` +
# sentence + `Ġ' Ġmeans <mask> . </s>`): its run.sh template `*cls*_This_sentence_:_'_*sent_0*_'_means*mask*.`
# is cut at the sentence and each side tokenized alone, so the closing quote keeps its space and the
# period, glued to the mask, has none. (Its evaluation script instead tokenizes the filled-in text,
# which gives the sentence's first word a leading space and appends "." to sentences without final
# punctuation; we use the training rows everywhere.)
ROBERTA_TEMPLATES = ("This sentence : '[X] ' means<mask>.", "The sentence : '[X] ' means<mask>.")
# Causal decoders, read at the template's last token: PromptEOL's template (kongds/scaling_sentemb,
# train_llm.sh), then PromptBERT's second template in the same form for two-template views.
PROMPTEOL_TEMPLATES = ('This sentence : "[X]" means in one word:"', 'This sentence of "[X]" means in one word:"')


def default_templates(family: BackboneFamily) -> tuple[str, ...]:
    """PromptBERT's template pair for the backbone's family: PromptEOL's on decoders, RoBERTa's token
    ids on RoBERTa-style models, BERT's otherwise."""
    if family.template_readout == "last":
        return PROMPTEOL_TEMPLATES
    return ROBERTA_TEMPLATES if family.name == "roberta" else BERT_TEMPLATES


class TemplateViews(Collator):
    """Views of sentences under templates, for the template methods' collators."""

    def views(
        self, examples: list[dict[str, list[int]]], columns: list[str], templates: list[Sequence[int]]
    ) -> dict[str, Any]:
        """Training batch in one forward: view v is column `columns[v]` of every example, example i
        under template `templates[v][i]`; bias rows follow when `denoise_train`."""
        rows = [example[column] for column in columns for example in examples]
        row_templates = [t for view in templates for t in view]
        features = self.format.build(rows, self.max_length, row_templates, self.hparams.denoise_train)
        batch = {"features": features, "num_views": len(columns), "batch_size": len(examples)}
        return self.add_guide_texts(batch, rows, row_templates)


class PromptBERTViews(TemplateViews):
    """Unsupervised: the sentence under each of the two templates (twice under the one template when
    only one is given); supervised: the NLI columns under template 0."""

    def __call__(self, examples: list[dict[str, list[int]]]) -> dict[str, Any]:
        n = len(examples)
        if "sent1" in examples[0]:
            columns = nli_columns(examples[0])
            return self.views(examples, columns, [[0] * n] * len(columns))
        second = 1 if len(self.format.templates) > 1 else 0
        return self.views(examples, ["sent0", "sent0"], [[0] * n, [second] * n])


class PromptMethod(SimCSE):
    """Shared by the template methods: the SimCSE loss over template-state views (the [MASK] state; a
    decoder's template-final state), template 0 at
    evaluation, denoising switches, and the sentence-transformers export.

    Denoising defaults: on in training on encoders (PromptBERT's unsupervised objective, ConPVP's
    footnote 1), off on decoders (PromptEOL trains and evaluates without it), off at validation and
    test, so checkpoints are selected on the same embedding that is tested and exported. The
    PromptBERT reference selects on denoised STS-B dev but reports undenoised test numbers (its
    supervised runs denoise both); set `denoise_val` / `denoise_test` to choose.

    Args:
        denoise_train / denoise_val / denoise_test: subtract the template bias in training,
            validation, and test (test also covers `encode` outside a trainer, `sentemb evaluate`
            and the export); `denoise_train` None = on for encoders, off for decoders.
        pooler: always "mask" (the state where the template is read: its mask token, or its last
            token on a decoder).
        **kwargs: see `SimCSE` and `SentEmbMethod` (the MLM auxiliary loss is not supported).
    """

    export_format = "template"  # `export.template.TemplateSentenceEncoder`
    mixture_options = frozenset()  # a template wraps the sentence: no instruction before it

    def __init__(
        self,
        backbone: str,
        denoise_train: bool | None = None,
        denoise_val: bool = False,
        denoise_test: bool = False,
        pooler: Literal["mask"] = "mask",
        **kwargs: Any,
    ) -> None:
        if pooler != "mask":
            raise SentEmbUserError(f"model.init_args.pooler: {type(self).__name__} pools where its template is read "
                                   f"('mask'); got {pooler!r}")
        if kwargs.get("mlm_weight", 0.0) > 0:
            raise SentEmbUserError(f"model.init_args.mlm_weight: {type(self).__name__} has no MLM auxiliary loss; "
                                   "set 0")
        super().__init__(backbone, pooler=pooler, **kwargs)

    def apply_family_defaults(self) -> None:
        super().apply_family_defaults()
        if self.hparams.denoise_train is None:
            self.hparams.denoise_train = not self.family.causal

    def eval_denoise(self) -> bool:
        """The denoising switch of the running stage: validation (and its sanity check), else test."""
        trainer = self._trainer
        if trainer is not None and (trainer.validating or trainer.sanity_checking):
            return self.hparams.denoise_val
        return self.hparams.denoise_test

    def features_from_ids(self, sentence_ids: list[list[int]]) -> dict[str, Tensor]:
        """Evaluation inputs: template 0, bias rows when the running stage denoises."""
        return self.encoder.format.build(sentence_ids, self.eval_length, denoise=self.eval_denoise())


class PromptBERT(PromptMethod):
    """PromptBERT. The first template is the evaluation template.

    Unsupervised (one-column corpus): view 1 under `templates[0]`, view 2 under `templates[1]`
    (the same template again when only one is given: dropout-only views). Supervised (NLI csv):
    `sent0`, `sent1` and `hard_neg` (or `hard_neg_1..k`) all under `templates[0]`, as in the reference.

    Defaults follow the paper (dev scored as test is); the code scores STS-B dev denoised (`denoise_val`), the "of"
    template first on BERT, and clipping to norm 1.0: its seed-row configs set those (docs/methods.md).

    Args:
        templates: template strings (see `encoders.template`); default by backbone family —
            BERT: `This sentence : "[X]" means [MASK] .`, `This sentence of "[X]" means [MASK] .`;
            RoBERTa: `This sentence : '[X] ' means<mask>.`, `The sentence : '[X] ' means<mask>.` (the
            reference's token ids, see `ROBERTA_TEMPLATES`); decoders: PromptEOL's
            `This sentence : "[X]" means in one word:"` and `This sentence of "[X]" means in one word:"`
            (the second is ours, for two-template unsupervised views: PromptEOL trains on NLI with one).
            (The reference's unsupervised BERT run puts the "of" template first and evaluates with it.)
        **kwargs: see `PromptMethod`.
    """

    collator_class = PromptBERTViews

    def __init__(self, backbone: str, templates: Sequence[str] | None = None, **kwargs: Any) -> None:
        super().__init__(backbone, **kwargs)

    def build_encoder(self) -> TemplateEncoder:
        templates = self.hparams.templates or default_templates(self.family)
        return TemplateEncoder(self.hparams.backbone, templates)

