"""DCPCSE (Jiang & Wang, 2022): SimCSE's objective on a frozen language model steered only by deep
continuous prompts, i.e. trainable key/value prefixes in every self-attention layer (P-tuning v2).

Paper / reference (github.com/YJiangcm/DCPCSE, now PromCSE) details, and the choices made here:

- Frozen: every backbone parameter (requires_grad=False), while the backbone stays in train mode:
  dropout, in the backbone and on the prefix, is what makes SimCSE's two views differ.
- Trainable: the prefix (`PrefixEncoder`, optionally reparameterized by an MLP), the training MLP,
  and with the MLM loss on, the MLM head minus its decoder matrix (see `PrefixTunedEncoder`).
- Sentence embedding: last-layer [CLS] + MLP in training only (unsupervised) or kept (supervised),
  as the reference's `--pooler_type cls [--mlp_only_train]`. Poolers see the sentence tokens only
  (the reference hands the prefix-extended attention mask to its avg poolers).
- Positions: `position_offset="shifted"` (default) numbers the sentence after the prefix, as the
  reference's transformers 4.2.1 did, so the paper's numbers hold; "zero" keeps pretraining
  positions (on all-MiniLM-L6-v2 the shift alone costs ~2 STS-B dev points before training, hence
  the demo's choice). Inputs are truncated at `max_sentence_length` (max_position_embeddings −
  prefix_len when shifted).
- ℓ = ℓ_CL + λ·ℓ_MLM with λ = mlm_weight · decay_rate^(global_step / decay_steps) (§2.2; the
  reference's trainer: continuous exponent, mlm_weight 0.1, 0.95, 100). The MLM forward goes
  through the prefix as in the reference, but draws its own prefix-dropout mask where the reference
  reuses the CL forward's draw: same expected gradient, and every forward keeps a fresh prefix cache.
- Supervised: SimCSE's NLI triplets; `hinge_weight` > 0 adds the reference's energy-based hinge
  (`losses.energy_hinge`; its runs use margin 0.2, weight 10).
- Checkpoints hold only the trainable tensors (`SentEmbMethod`'s rule for a frozen backbone); `backbone`
  (a hyper-parameter) names what they attach to. Exports hold the prefix and that reference (with LoRA
  on top, the backbone itself, merged or as an adapter).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from transformers import PreTrainedConfig

from ..backbones import UnsupportedBackbone
from ..encoders.packed import SENTEMB_ATTENTION, TokenLayout, layout_of
from ..encoders.plain import LAYER_POOLERS, Encoder
from ..encoders.prefix import PositionOffset, PrefixedBackbone, prefix_parameter_count
from ..errors import SentEmbUserError
from ..losses.energy_hinge import InfoNCEHingeLoss
from .simcse import SimCSE

__all__ = ["DCPCSE", "PrefixTunedEncoder", "trainable_parameter_count"]


class PrefixTunedEncoder(Encoder):
    """`Encoder` whose backbone runs with deep prefixes; the backbone is frozen (LoRA adapters, when set,
    train with the prefix).

    MLM head (with `with_mlm_head`): loaded from the checkpoint when it has one, else fresh with its
    decoder tied to the word embeddings (the `Encoder` rule). Its decoder matrix stays tied, hence
    frozen; its transform and output bias train. The reference trains its whole head, untied (a fresh
    one for BERT, whose checkpoint names do not match; RoBERTa's own): 23-39M parameters for base
    models, where ours adds h² + 3h + vocab (622,650 for bert-base). A frozen head would leave the
    fresh head of a checkpoint without one (e.g. all-MiniLM-L6-v2) random. The head serves training
    only: checkpointed (so runs resume), never exported.
    """

    def __init__(
        self,
        backbone: str,
        pooler: str = "cls",
        with_mlm_head: bool = False,
        prefix_len: int = 16,
        projection: bool = False,
        projection_hidden_size: int = 512,
        dropout: float | None = None,
        position_offset: PositionOffset = "shifted",
    ) -> None:
        super().__init__(backbone, pooler, with_mlm_head)
        refusal = self.family.prefix_refusal(self.backbone)
        if refusal is not None:
            raise UnsupportedBackbone(refusal)
        if self.attn_implementation not in (None, "sdpa"):
            raise SentEmbUserError("model.init_args.attn_implementation: DCPCSE's prefix joins the padded forward's "
                                   f"attention through SDPA, not {self.attn_implementation}; use null, padded or sdpa")
        self.padded_attention = SENTEMB_ATTENTION  # SDPA with the prefix
        self.prefixed = PrefixedBackbone(
            self.backbone, prefix_len, projection, projection_hidden_size, dropout, position_offset
        )

    def load_backbone(self, **options: Any) -> None:
        super().load_backbone(**options)
        self.prefixed.backbone = self.backbone.requires_grad_(False)  # frozen, as `PrefixedBackbone` keeps it

    @property
    def max_length(self) -> int:
        return min(super().max_length, self.prefixed.max_sentence_length)

    def run_backbone(self, features: dict[str, Tensor]) -> Any:
        return self.prefixed(
            features["input_ids"],
            features["attention_mask"],
            output_hidden_states=self.pooler in LAYER_POOLERS,
            layout=layout_of(features) if self.padding_free else None,
            kernel=self.packed_kernel,
        )

    def mlm_hidden_states(self, input_ids: Tensor, attention_mask: Tensor, layout: TokenLayout | None) -> Tensor:
        """MLM through the prefix too, so the auxiliary loss trains it (as in the reference); packed with
        the batch's layout when the encoder is."""
        if self.padding_free:
            layout = layout_of({"attention_mask": attention_mask, "layout": layout})
        else:
            layout = None
        return self.prefixed(input_ids, attention_mask, layout=layout, kernel=self.packed_kernel).last_hidden_state


def trainable_parameter_count(
    config: PreTrainedConfig,
    prefix_len: int,
    projection: bool = False,
    projection_hidden_size: int = 512,
    mlp: bool = True,
    mlm_head: bool = False,
) -> int:
    """Trainable parameters of a `DCPCSE` on a backbone with `config`, from the config alone:
    prefix + training MLP (h² + h) + the MLM head's transform and output bias (h² + 3h + vocab),
    assuming BERT/RoBERTa heads with the decoder tied to the word embeddings."""
    hidden = config.hidden_size
    count = prefix_parameter_count(config, prefix_len, projection, projection_hidden_size)
    if mlp:
        count += hidden * hidden + hidden
    if mlm_head:
        count += hidden * hidden + 3 * hidden + config.vocab_size
    return count


class DCPCSE(SimCSE):
    """SimCSE (unsupervised or NLI-supervised) through a frozen backbone with deep prefixes.

    Defaults are the paper's (Appendix A); its code (YJiangcm/DCPCSE at 22c52f9) agrees, and its trainer clips
    gradients to norm 1.0, which the seed-row configs set (docs/methods.md, reproduction configs).

    Args:
        prefix_len: prefix vectors per layer (paper Tables 3-4: 16 BERT-base, 14 RoBERTa-base,
            10 large models unsupervised; 12 BERT, 10 RoBERTa supervised).
        prefix_projection: reparameterize the prefix through a two-layer MLP (P-tuning v2's
            option; the reference's default and the paper: off).
        prefix_hidden_size: hidden size of that MLP.
        prefix_dropout: dropout on the prefix; None = the backbone's hidden_dropout_prob (reference).
        position_offset: "shifted" (reference) or "zero", see `PrefixedBackbone`.
        mlm_decay_rate, mlm_decay_steps: λ = mlm_weight · rate^(step / steps); `mlm_weight` (0.1 in
            the paper's multi-task runs, 0 = off) comes from `SentEmbMethod`.
        hinge_weight: weight of the energy-based hinge term (0 = off; the reference's runs: 10).
        hinge_margin: its margin (reference: 0.2).
        lr: default 3e-2, the paper's unsupervised BERT-base value (prefixes need far larger
            steps than full fine-tuning).
        **kwargs: see `SimCSE` and `SentEmbMethod`.
    """

    export_format = "prefix"  # `export.prefix.PrefixedTransformer`: the prefix and a reference to the backbone
    mixture_options = frozenset()  # SimCSE's loss, but its prefixed forward is not tested with instructions

    def __init__(
        self,
        backbone: str,
        prefix_len: int = 16,
        prefix_projection: bool = False,
        prefix_hidden_size: int = 512,
        prefix_dropout: float | None = None,
        position_offset: PositionOffset = "shifted",
        mlm_decay_rate: float = 0.95,
        mlm_decay_steps: int = 100,
        hinge_weight: float = 0.0,
        hinge_margin: float = 0.2,
        lr: float = 3e-2,
        **kwargs: Any,
    ) -> None:
        super().__init__(backbone, lr=lr, **kwargs)
        if hinge_weight > 0:
            self.loss_fn = InfoNCEHingeLoss(
                self.hparams.temperature, self.hparams.hard_negative_weight, hinge_margin, hinge_weight
            )

    def build_encoder(self) -> PrefixTunedEncoder:
        hp = self.hparams
        return PrefixTunedEncoder(
            hp.backbone, hp.pooler, hp.mlm_weight > 0, hp.prefix_len, hp.prefix_projection,
            hp.prefix_hidden_size, hp.prefix_dropout, hp.position_offset,
        )

    def mlm_weight_at(self, step: int) -> float:
        """λ = mlm_weight · decay_rate^(step / decay_steps): the MLM weight decays exponentially."""
        return self.hparams.mlm_weight * self.hparams.mlm_decay_rate ** (step / self.hparams.mlm_decay_steps)
