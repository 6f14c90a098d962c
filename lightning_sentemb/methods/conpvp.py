"""ConPVP (Zeng et al., 2022): contrastive learning with prompt-derived virtual semantic prototypes.

The anchor v_i is the [MASK] state of `[X] <p1>…<pk> [MASK] .` with k learnable prompt vectors. The
positive prototype c⁺_i is the [MASK] state of the sentence in a template sampled from the basic set,
the negative prototype c⁻_i the same with a template from the semantically-opposite set (Table 1).
Eq. 1, l_i = −log exp(s(v_i,c⁺_i)/τ) / Σ_j [exp(s(v_i,c⁺_j)/τ) + exp(s(v_i,c⁻_j)/τ)], is SimCSE's
InfoNCE with c⁺ as positives and c⁻ as hard negatives (weight 0), so the loss is inherited.
Anchors, prototypes and their template-bias rows go through the encoder in one forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch

from ..encoders.template import PromptInit, TemplateEncoder
from ..errors import SentEmbUserError
from .guide import guide_reads_text
from .promptbert import PromptMethod, TemplateViews

# Table 1 of the paper. The PDF text garbles the quotes; they are written here as `"` around the
# sentence, glued to it (see encoders.template on BPE tokenization).
POSITIVE_TEMPLATES = (
    'Given "[X]", we assume that "[MASK]"',
    '"[X]", is this review positive ? [MASK] .',
    '"[X]", is [MASK] news',
    '"[X]", is a [MASK] one',
    '"[X]" . In summary : "[MASK]"',
    'By "[X]" they mean [MASK] .',
    'Article "[X]" belongs to a [MASK] topic',
    'This sentence : "[X]" means [MASK] .',
)
NEGATIVE_TEMPLATES = (
    '"[X]", is this review negative ? [MASK] .',
    'Without "[X]", they mean [MASK] .',
    '"[X]" is inconsistent with "[MASK]"',
    '"[X]" is totally different from : "[MASK]"',
    '"[X]" which does not denote [MASK]',
    '"[X]" is not a [MASK] one',
    'This sentence : "[X]" does not mean [MASK] .',
    'Article "[X]" is definitely not about the [MASK] topic',
)

Prototypes = Literal["both", "positive", "none"]


class ConPVPViews(TemplateViews):
    """The anchor under template 0, its positive prototype under a template drawn from the basic set
    and (prototypes "both") its negative one under a template drawn from the opposite set."""

    def __call__(self, examples: list[dict[str, list[int]]]) -> dict[str, Any]:
        n = len(examples)
        if self.hparams.prototypes == "none":
            return self.views(examples, ["sent0", "sent0"], [[0] * n, [0] * n])
        num_positive = len(self.hparams.positive_templates)
        views = [[0] * n, (1 + torch.randint(num_positive, (n,), generator=self.generator)).tolist()]
        if self.hparams.prototypes == "both":
            first_negative = 1 + num_positive
            negatives = torch.randint(len(self.hparams.negative_templates), (n,), generator=self.generator)
            views.append((first_negative + negatives).tolist())
        return self.views(examples, ["sent0"] * len(views), views)


class ConPVP(PromptMethod):
    """ConPVP on a one-column corpus (other columns are ignored).

    Defaults are the paper's; its code (lemon0830/promptCSE, ConPVP.zip) adds the trainer's clip to norm 1.0,
    which the seed-row configs set (docs/methods.md, reproduction configs).

    On a causal decoder the [MASK] state becomes the state of the token before [MASK] (each template is
    cut there, `encoders.template`), e.g. `"[X]", is this review positive ?`, and the anchor reads its
    last prompt vector; denoising is then off by default, as in PromptEOL (`denoise_train`).

    Templates are sampled per example at every training step from `collate_generator`, seeded per
    batch from the run seed, so they are reproducible, differ across DataLoader workers and repeat
    after a resume (the reference fixes one template per example at preprocessing). Training embeddings are
    template-denoised (`denoise_train`, the paper's footnote 1) — anchors and prototypes alike, each
    against its own template's bias.

    Args:
        prompt_length: k, the number of continuous prompt vectors of the anchor (paper: 4).
        anchor_template: a discrete anchor template instead of the continuous prompt (ablation
            "w/ manual", e.g. `This sentence : "[X]" means [MASK] .`); None = `[X] [P]×k [MASK] .`.
        positive_templates / negative_templates: the basic and semantically-opposite sets.
        prototypes: "both" (Eq. 1); "positive" (ablation "w/o c⁻": only c⁺_j in the denominator);
            "none" (ablation "w/o c⁺ & c⁻": the anchor twice, i.e. continuous-prompt SimCSE).
        prompt_init: initialization of the k prompt vectors: "uniform" U[0, 1) (default: the
            reference's `torch.rand`, never re-initialized; the paper does not say) or "normal"
            N(0, initializer_range²) like the backbone's word embeddings.
        **kwargs: see `PromptMethod` (denoising switches) and `SentEmbMethod`.
    """

    collator_class = ConPVPViews

    def __init__(
        self,
        backbone: str,
        prompt_length: int = 4,
        anchor_template: str | None = None,
        positive_templates: Sequence[str] = POSITIVE_TEMPLATES,
        negative_templates: Sequence[str] = NEGATIVE_TEMPLATES,
        prototypes: Prototypes = "both",
        prompt_init: PromptInit = "uniform",
        **kwargs: Any,
    ) -> None:
        if prototypes not in ("both", "positive", "none"):
            raise ValueError(f"prototypes must be both, positive or none; got {prototypes!r}")
        if prototypes == "both" and guide_reads_text(kwargs.get("guide")):
            raise SentEmbUserError(
                "model.init_args.guide: ConPVP's negative prototypes are the anchor's own sentence under negating "
                "templates, which a guide reading the text cannot tell from its positive; use guide: self, or "
                "prototypes: positive"
            )
        super().__init__(backbone, **kwargs)

    def build_encoder(self) -> TemplateEncoder:
        """Template 0 is the anchor, then the positive set, then the negative set."""
        h = self.hparams
        anchor = h.anchor_template or "[X]" + " [P]" * h.prompt_length + " [MASK] ."
        templates = [anchor, *h.positive_templates, *h.negative_templates]
        return TemplateEncoder(h.backbone, templates, h.prompt_init)
