"""DCLR (Zhou et al., ACL 2022): SimCSE's dropout views with noise-based negatives, sampled from a
Gaussian and made harder by gradient ascent, and instance weighting, a frozen complementary model (the
paper's: a trained unsupervised SimCSE) weighing 0 the in-batch negatives it scores at or above φ.

The complementary model is the guide (`model.init_args.guide`, `methods.guide`) with a fixed threshold
φ: one frozen-model mechanism for GISTEmbed's filter and DCLR's weights. The loss is `losses.dclr`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch import Callback
from torch import Tensor

from ..data.loader import batch_seed
from ..distributed import gather_with_grad, local_labels
from ..errors import SentEmbUserError, check_choice
from ..losses.dclr import Objective, dclr_loss, harder_noise
from .base import SentEmbMethod
from .guide import GuideOption
from .simcse import SimCSEViews

NOISE_KEY = 0x44434C52  # "DCLR": the noise's seeds are their own, unrelated to dropout's


def complementary_guide(guide: GuideOption | str, phi: float, objective: Objective) -> dict[str, Any] | None:
    """The guide option DCLR's weighting is: the user's complementary model (`model`, `pooler`) with
    the threshold φ; the paper's "≥ φ" drops a tie, the reference's "> φ" keeps it."""
    if guide is None:
        return None
    option = {"model": guide} if isinstance(guide, str) else guide
    if not isinstance(option, Mapping) or set(option) - {"model", "pooler"}:
        raise SentEmbUserError(f"model.init_args.guide: DCLR's complementary model takes model and pooler (its "
                               f"threshold is model.init_args.phi); got {guide!r}")
    return {**option, "threshold": phi, "ties": "dropped" if objective == "paper" else "kept",
            "drop_duplicates": False}


class DCLR(SentEmbMethod):
    """DCLR on a one-sentence-a-line corpus: the sentence twice (dropout is the augmentation), in-batch
    negatives weighted by the complementary model, and noise-based negatives. Under DDP the negatives
    are the global batch's and every rank draws and moves the same noise (seeded without the rank, moved
    against the gathered anchors), so k processes train as one.

    Where the paper and the reference code (RUCAIBox/DCLR) differ, both are here and the paper is the
    default (`objective`):
    - the loss: the paper's Eq. 6 has the positive in the numerator only and removes a weight-0
      negative; the code's is a binary cross-entropy on the softmax of the weighted logits, the positive
      in the denominator and a weight-0 logit set to 0 (`losses.dclr`);
    - the noise ascent: the paper's L_U (Eq. 3) contrasts the positive with the noise alone, at τ_u; the
      code ascends SimCSE's cross-entropy over the in-batch columns and the noise, at τ;
    - the threshold: the paper's weight is 0 at or above φ, the code's above φ (it compares cos/τ with
      20φ, the same at its τ 0.05).
    The paper does not give σ, β, t or τ_u: the defaults are the code's (torch.randn, 1e-3, its `pgd`
    default 4, which run.sh keeps, and the loss's τ). Both weigh the noise negatives 1: the paper's Eq. 5
    weighs "a negative" of either kind, but a complementary model scores sentences and the noise is no
    sentence (the code's `cos_sim_negative_fix` is 0). Not reproduced, as quirks of the code rather than
    the method: its complementary model runs in training mode (dropout on the scores) and on both dropout
    views, where the guide is in eval mode and embeds each text once; its training forward omits the
    attention mask (padding attended to); its trainee reads BERT's pooler layer then the MLP.

    The defaults are the paper's; the code behind the published rows differs in `objective` (reference),
    which the seed-row configs set with its selection on the mean of STS-B and SICK-R dev (docs/methods.md).

    The noise count is `int(noise_times × global batch)` vectors shared by all anchors, as in the code
    (the paper's k, a proportion of the batch in its §6.5). Supervised files: the hard negatives join the
    in-batch negatives, weighed like them (DCLR is unsupervised).

    Args:
        phi: φ, the complementary model's similarity at which an in-batch negative gets weight 0 (paper
            and run.sh: 0.9 on BERT, 0.85 on RoBERTa). Needs `guide`.
        guide: the complementary model, `{model: M, pooler: P}` (the paper: unsupervised SimCSE, e.g.
            princeton-nlp/unsup-simcse-bert-base-uncased with pooler cls), or `self` (the paper's "self
            instance weighting" ablation); null = no instance weighting (ablation "w/o instance weighting").
        noise_times: noise negatives per example of the global batch (run.sh: 1 BERT-base, 2.5
            RoBERTa-base, 3 BERT-large, 5 RoBERTa-large); 0 = none (ablation "w/o noise-based negatives").
        noise_std: σ of the Gaussian the noise starts from.
        noise_steps: t, gradient-ascent steps on the noise; 0 = the paper's "random noise" ablation.
        noise_step_size: β, the length of each step.
        noise_temperature: the temperature of the noise's ascent (the paper's τ_u); None = `temperature`,
            the code's.
        objective: "paper" (Eq. 3, 6) or "reference" (the code's loss and ascent; see above).
        global_batch: the global batch (data.batch_size × devices × nodes) a fit must train at, else it stops
            in one line naming the per-device batch: the negatives, in-batch and noise, are the global
            batch's, so a config written for 4 devices must not run at a quarter of it on one; null = any.
        **kwargs: see `SentEmbMethod`.
    """

    collator_class = SimCSEViews

    def __init__(
        self,
        backbone: str,
        phi: float = 0.9,
        noise_times: float = 1.0,
        noise_std: float = 1.0,
        noise_steps: int = 4,
        noise_step_size: float = 1e-3,
        noise_temperature: float | None = None,
        objective: Objective = "paper",
        guide: GuideOption = None,
        global_batch: int | None = None,
        **kwargs: Any,
    ) -> None:
        check_choice("model.init_args.objective", objective, Objective)
        for name, value in {"noise_times": noise_times, "noise_std": noise_std, "noise_steps": noise_steps,
                            "noise_step_size": noise_step_size}.items():
            if value < 0:
                raise SentEmbUserError(f"model.init_args.{name} must be >= 0, got {value}")
        super().__init__(backbone, guide=complementary_guide(guide, phi, objective), **kwargs)
        self.noise_seed: int | None = None

    def configure_callbacks(self) -> list[Callback]:
        """Refuses a fit whose global batch is not `global_batch`, before it starts."""
        trainer, expected = self._trainer, self.hparams.global_batch
        if expected and trainer is not None and trainer.state.fn == "fit":
            per_device, devices = trainer.datamodule.hparams.batch_size, trainer.world_size
            if per_device * devices != expected:
                fix = (f"set data.batch_size {expected // devices}" if expected % devices == 0 else
                       f"train on a number of devices that divides {expected}")
                raise SentEmbUserError(
                    f"model.init_args.global_batch {expected}: this fit's global batch is data.batch_size "
                    f"{per_device} x {devices} device(s) = {per_device * devices}; {fix}")
        return super().configure_callbacks()

    def on_train_batch_start(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Dropout's per-batch seeding, and the noise's seed: the run's, the epoch's and the batch's, not
        the rank's (every rank draws the same noise), so a resumed run draws what the uninterrupted one did."""
        super().on_train_batch_start(batch, batch_idx)
        self.noise_seed = batch_seed(NOISE_KEY, self.run_seed, self.current_epoch, batch_idx)

    def noise(self, count: int, like: Tensor) -> Tensor:
        """`count` draws of N(0, σ²) of the full embedding size, cut to `like`'s width (a Matryoshka
        truncation sees the first dimensions of the same draws), from a generator on `like`'s device seeded
        for this batch (`on_train_batch_start`; outside a fit, from the run seed alone)."""
        seed = self.noise_seed if self.noise_seed is not None else batch_seed(NOISE_KEY, self.run_seed)
        generator = torch.Generator(like.device).manual_seed(seed)
        dtype = torch.promote_types(like.dtype, torch.float32)
        draws = torch.randn(count, self.output_size, generator=generator, device=like.device, dtype=dtype)
        return self.hparams.noise_std * draws[:, : like.size(-1)]

    def embedding_loss(
        self, embeddings: Tensor, batch: dict[str, Any], drop: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        hp = self.hparams
        views = embeddings.unflatten(0, (batch["num_views"], -1))
        anchors = views[0]
        candidates = torch.cat([gather_with_grad(view) for view in views[1:]])
        labels = local_labels(anchors.size(0), anchors.device)
        global_batch = candidates.size(0) // (batch["num_views"] - 1)
        noise = self.noise(int(hp.noise_times * global_batch), anchors)
        if noise.size(0) and hp.noise_steps:
            all_anchors = gather_with_grad(anchors.detach())
            noise = harder_noise(noise, all_anchors, candidates, torch.arange(global_batch, device=noise.device),
                                 hp.noise_steps, hp.noise_step_size, hp.noise_temperature or hp.temperature,
                                 hp.objective)
        loss = dclr_loss(anchors, candidates, noise, labels, hp.temperature, drop, hp.objective)
        return loss, {}
