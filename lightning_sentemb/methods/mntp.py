"""MNTP, masked next-token prediction (BehnamGhader et al., 2024, "LLM2Vec"; reference McGill-NLP/llm2vec,
experiments/run_mntp.py): the second of LLM2Vec's three steps, adapting a decoder to the bidirectional
attention switched on in the first (`bidirectional`, on by default here).

A fraction of each sentence's tokens is corrupted (BERT's 80/10/10 by default: the mask token, a random
token, the token itself); token i is predicted from the output at i − 1 through the backbone's own causal-LM
head, as the reference does by training its bidirectional model with the causal LM's shifted loss on
masked-LM labels: the state at i − 1 predicts token i, so a decoder made bidirectional keeps reading its
pretrained head the way it was trained. The collator picks the states that predict (`PredictedTokens`
with shift 1), and the head runs on those alone. Decoders have no mask token: the reference's default
("blank") writes "_", `mask_token` here.

What trains: LoRA adapters, or without `lora` the whole backbone. An untied LM head stays as loaded: the
reference leaves its (untied) head trainable outside peft and drops it when saving the adapters, so only
the backbone's change carries over to the next stage, as here. A head tied to the input embeddings
(Qwen2-0.5B, Gemma, Qwen3) is those embeddings: it trains with the backbone in full fine-tuning (the
reference trains its head too) and stays frozen under LoRA, as the embeddings do. Its corpus is Wikitext-103 cut into
512-token blocks; this method reads the sentences of a corpus one per row, as every unsupervised
method here (wiki1m). The sentence embedding (validation, export) is the backbone's, pooled by
`pooler` (mean, what LLM2Vec's SimCSE stage uses).
"""

from __future__ import annotations

from typing import Any, Literal

from torch import Tensor

from ..encoders.plain import Encoder
from ..errors import SentEmbUserError, check_choice
from ..losses.mlm import PredictedTokens, mask_tokens, token_prediction_loss
from .base import Pooler, SentEmbMethod
from .collator import Collator

MaskReplace = Literal["bert", "all"]


class MNTPViews(Collator):
    """Each sentence once, corrupted, with its chosen tokens and the states that predict them (the one
    before each)."""

    def __call__(self, examples: list[dict[str, list[int]]]) -> dict[str, Any]:
        hp = self.hparams
        features = self.format.build([example["sent0"] for example in examples], max_length=None)
        tokenizer = self.format.tokenizer
        mask_id = tokenizer.mask_token_id
        if mask_id is None:
            mask_id = tokenizer.convert_tokens_to_ids(hp.mask_token)
        ids, labels = mask_tokens(features["input_ids"], features["attention_mask"], tokenizer, hp.mask_probability,
                                  self.generator, mask_id, 0.8 if hp.mask_replace == "bert" else 1.0)
        return {"features": {**features, "input_ids": ids}, "predicted": PredictedTokens.from_labels(labels, shift=1),
                "num_views": 1}


class MNTP(SentEmbMethod):
    """Masked next-token prediction on a decoder, with LoRA in the LLM2Vec recipe.

    Args:
        mask_probability: fraction of each sentence's tokens that is predicted (LLM2Vec's Llama-3 run: 0.2;
            its Mistral run: 0.8 with `mask_replace: all`).
        mask_replace: "bert" (80% mask token, 10% random, 10% kept; the reference's default collator) or
            "all" (every chosen token masked; its `all_mask` collator).
        mask_token: the token written where a decoder's tokenizer has no mask token ("_", the reference's
            "blank"); a tokenizer that has one uses it.
        bidirectional: on, as LLM2Vec trains MNTP (see `SentEmbMethod`).
        pooler: the sentence embedding for validation and export (avg: LLM2Vec's mean pooling).
        **kwargs: see `SentEmbMethod` (no MLP, MLM auxiliary loss or gradient caching: there is no
            contrastive loss here).
    """

    collator_class = MNTPViews

    def __init__(
        self,
        backbone: str,
        mask_probability: float = 0.2,
        mask_replace: MaskReplace = "bert",
        mask_token: str = "_",
        bidirectional: bool = True,
        pooler: Pooler | None = "avg",
        mlp: Literal["none"] = "none",
        **kwargs: Any,
    ) -> None:
        for option in ("mlm_weight", "grad_cache_chunk", "matryoshka_dims", "guide"):
            if kwargs.get(option):
                raise SentEmbUserError(f"model.init_args.{option}: MNTP has no contrastive or auxiliary loss; unset it")
        if mlp != "none":
            raise SentEmbUserError(f"model.init_args.mlp: MNTP trains no projection; set none (got {mlp!r})")
        if not 0 < mask_probability < 1:
            raise SentEmbUserError(f"model.init_args.mask_probability must be in (0, 1), got {mask_probability}")
        check_choice("model.init_args.mask_replace", mask_replace, MaskReplace)
        super().__init__(backbone, pooler=pooler, mlp=mlp, bidirectional=bidirectional, **kwargs)
        tokenizer = self.tokenizer
        unknown = (None, tokenizer.unk_token_id)
        if tokenizer.mask_token_id is None and tokenizer.convert_tokens_to_ids(mask_token) in unknown:
            raise SentEmbUserError(f"model.init_args.mask_token {mask_token!r} is not one token of the "
                                   f"{self.family.model_type} tokenizer; name one that is")

    def build_encoder(self) -> Encoder:
        return Encoder(self.hparams.backbone, self.hparams.pooler, with_lm_head=True)

    def training_loss(self, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        return token_prediction_loss(self.encoder, batch["features"], batch["predicted"]), {}
