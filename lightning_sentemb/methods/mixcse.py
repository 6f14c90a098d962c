"""MixCSE (Zhang et al., AAAI 2022, "Unsupervised Sentence Representation via Contrastive Learning with
Mixing Negatives"; reference BDBC-KG-NLP/MixCSE_AAAI2022): unsupervised SimCSE (dropout views) whose
denominator gains hard negatives mixed from an anchor's positive and an in-batch negative (`losses.mixcse`).

Where the paper and the reference code differ (both supported, the paper's the default):

- which columns (`mix_layout`): the paper adds each anchor's own mixed negative to its denominator; the
  reference adds every sentence's mix to every anchor's, plus the anchors mixed alike and scored against
  the positives, the mixes holding the anchor's own positive at logit 0 (`losses.mixcse`);
- the partner (`mix_with`): a negative drawn at random from the batch (paper) or the next sentence of the
  batch (reference; the batch is shuffled, so a random other sentence too, but a fixed pairing).

Selection (`val_mlp`): the reference trains without `--mlp_only_train`, so its dev score, which selects
the checkpoint, reads the MLP, while its test (`evaluation.py --pooler cls_before_pooler`) does not;
`val_mlp: true` validates through the MLP, test, `encode` and exports stay without it.

Under DDP the global batch is put in its examples' order (as one process holds it) and the partners are
drawn over it from (run seed, global step) on every rank, so k processes mix as one; the draw repeats
after a resume and is made once for every Matryoshka truncation (`prepare_truncations`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..data.loader import batch_seed, gathered_position
from ..distributed import gather_with_grad, local_labels, world
from ..errors import SentEmbUserError, check_choice
from ..losses.mixcse import MixCSELoss, MixLayout, MixWith, mixing_partners
from .base import SentEmbMethod
from .simcse import SimCSEViews
from .validation import validating

PARTNER_STREAM = 0x4D6978  # keeps the partners' random stream apart from any other drawn from the run seed


def example_order(size: int, local: int, device: torch.device) -> Tensor:
    """Where each example of the global batch sits once gathered rank after rank (`data.loader.rank_rows`:
    rank r holds every size-th example from r)."""
    return gathered_position(size * local, size, local, device)


class MixCSE(SentEmbMethod):
    """MixCSE on a one-sentence-a-line corpus (the sentence twice: dropout is the augmentation). The defaults
    are the paper's; the code behind the published rows differs in `mix_layout` (reference) and `val_mlp`
    (true), which the seed-row config sets (docs/methods.md).

    Args:
        mix_lambda: λ, the positive's share of a mixed negative (paper: 0.2).
        num_mixed: mixed negatives per anchor, each with another partner (paper: 1; layout "paper" only).
        mix_with: "random" (paper) or "next" (reference): the in-batch negative mixed with the positive; null
            = the layout's own.
        stop_gradient: the mixed negatives as constants (paper and reference); false back-propagates
            through them (the ablation).
        mix_layout: "paper" or "reference" (module docstring); "reference" mixes each sentence with the
            next one, once.
        val_mlp: validate through the MLP (the reference's selection), with `mlp: train`; test, `encode`
            and exports never apply it.
        **kwargs: see `SentEmbMethod`.
    """

    collator_class = SimCSEViews

    def __init__(self, backbone: str, mix_lambda: float = 0.2, num_mixed: int = 1, mix_with: MixWith | None = None,
                 stop_gradient: bool = True, mix_layout: MixLayout = "paper", val_mlp: bool = False,
                 **kwargs: Any) -> None:
        check_choice("model.init_args.mix_with", mix_with, MixWith, allow_none=True)
        check_choice("model.init_args.mix_layout", mix_layout, MixLayout)
        if not 0 <= mix_lambda <= 1 or num_mixed < 1:
            raise SentEmbUserError(f"model.init_args: MixCSE takes 0 <= mix_lambda <= 1 and num_mixed >= 1; got "
                                   f"mix_lambda {mix_lambda}, num_mixed {num_mixed}")
        if mix_layout == "reference" and (num_mixed != 1 or mix_with not in (None, "next")):
            raise SentEmbUserError("model.init_args.mix_layout reference mixes each sentence with the next one, once: "
                                   "leave mix_with and num_mixed unset (or use mix_layout paper)")
        super().__init__(backbone, **kwargs)
        if val_mlp and self.hparams.mlp != "train":
            raise SentEmbUserError(f"model.init_args.val_mlp validates through the MLP trained and dropped at test "
                                   f"(mlp: train); got mlp: {self.hparams.mlp}")
        self.loss_fn = MixCSELoss(mix_lambda, self.hparams.temperature, stop_gradient)
        if self.hparams.mix_with is None:  # checkpoints keep the value
            self.hparams.mix_with = "next" if mix_layout == "reference" else "random"

    def project(self, pooled: Tensor) -> Tensor:
        """The MLP in training and, with `val_mlp`, in validation; elsewhere as `SentEmbMethod.project`."""
        if self.hparams.val_mlp and not self.training and validating(self):
            return self.mlp(pooled)
        return super().project(pooled)

    def partners(self, total: int, device: torch.device) -> Tensor:
        """(total, num_mixed) partners of every row of the global batch (`losses.mixcse.mixing_partners`),
        the random ones drawn from (run seed, global step): every rank and truncation draws the same."""
        hp = self.hparams
        generator = None
        if hp.mix_with == "random":
            seed = batch_seed(self.run_seed, self.global_step, PARTNER_STREAM)
            generator = torch.Generator(device=device).manual_seed(seed)
        if hp.num_mixed >= total:
            raise SentEmbUserError(f"model.init_args.num_mixed {hp.num_mixed}: a global batch of {total} has "
                                   f"{total - 1} other sentences to mix with; lower it or raise data.batch_size")
        return mixing_partners(total, hp.num_mixed, hp.mix_with, generator, device)

    def prepare_truncations(self, embeddings: Tensor, batch: dict[str, Any]) -> dict[str, Any]:
        """Matryoshka: the paper layout's partners drawn once a step, shared by every truncation."""
        if self.hparams.mix_layout == "reference":  # it mixes each sentence with the next: nothing drawn
            return batch
        total = embeddings.size(0) // batch["num_views"] * world()[1]
        return {**batch, "partners": self.partners(total, embeddings.device)}

    def embedding_loss(
        self, embeddings: Tensor, batch: dict[str, Any], drop: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        if batch["num_views"] != 2:
            raise SentEmbUserError(f"MixCSE is unsupervised (two dropout views of each sentence); got "
                                   f"{batch['num_views']} views: train on a one-sentence-a-line corpus")
        hp = self.hparams
        anchors, positives = embeddings.unflatten(0, (2, -1))
        positives = gather_with_grad(positives)
        local, device = anchors.size(0), anchors.device
        labels = local_labels(local, device)
        rank, size = world()
        order = example_order(size, local, device) if size > 1 else None
        if order is not None:  # the global batch in its examples' order: the partners are one process's
            positives = positives.index_select(0, order)
            drop = None if drop is None else drop.index_select(1, order)
            labels = torch.arange(local, device=device) * size + rank
        if hp.mix_layout == "reference":
            all_anchors = gather_with_grad(anchors.detach() if hp.stop_gradient else anchors)
            all_anchors = all_anchors if order is None else all_anchors.index_select(0, order)
            return self.loss_fn.reference(anchors, positives, all_anchors, labels, drop), {}
        drawn = batch["partners"] if "partners" in batch else self.partners(positives.size(0), device)
        partners = drawn[labels]
        return self.loss_fn.paper(anchors, positives, labels, partners, drop), {}
