"""The guide of `model.init_args.guide`: a false-negative filter for every method (`losses.guide`).

A guide is any model `sentemb evaluate` reads (checkpoint, export, hub name, `pkg:`), frozen and in
eval mode, with GISTEmbed's rule; or the method itself (`self`), with Qwen3-Embedding's: its own
detached similarities, a negative leaving when it scores above the positive + 0.1. Its cosine
similarities between the rows the loss scores decide which negatives leave the denominator; with
`threshold` (DCLR's φ) a fixed score replaces the positive's. `drop_duplicates` (on by default) also
drops a candidate whose text is the anchor's positive's: Qwen3-Embedding's second rule, and for a guide
model what sentence-transformers gets from its no-duplicates batch sampler (off: `GISTEmbedLoss`
exactly).

`SentEmbMethod.sentence_loss` computes the mask once a batch (`guide_drop`), from the full-size embeddings of
the views the loss reads (every Matryoshka truncation, the cached loss of gradient caching, each DDP rank:
the same mask), and passes it to the method's `embedding_loss` as `drop`.

Its inputs: the batch holds the trainee's token ids, which a guide with another tokenizer, template
or length cannot read. The collator decodes each row's ids back to text (`Collator.add_guide_texts`,
in the DataLoader's workers) and the guide tokenizes that text in its own format, as
sentence-transformers' GISTEmbedLoss does when the tokenizers differ. The guide then judges exactly
what the trainee sees (its `max_seq_len` truncation and, for an uncased trainee, lower case), and the
corpus cache stays one tokenization. Each distinct text is embedded once per batch, so identical
texts (the two views of unsupervised SimCSE) get identical guide vectors. The collator also keys each
row by its token ids and template (`row_keys`), for `drop_duplicates`.

The guide model is held outside the module tree: it is not in the method's `state_dict`, parameters
or optimizer, DDP and FSDP never wrap it, and the trainer's `train()` cannot switch it out of eval
mode. It is loaded on first use (training), so loading a guided checkpoint for evaluation never reads
the guide.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypedDict

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from ..distributed import gather_with_grad, local_labels
from ..errors import SentEmbUserError
from ..loading import load_method
from ..losses.guide import false_negative_mask, masked_fraction
from ..losses.threshold import MARGIN_STRATEGIES, TIES, MarginStrategy, Ties

__all__ = ["GUIDE_DEFAULTS", "Guide", "GuideOption", "GuideSettings", "guide_reads_text", "guide_settings"]


class GuideSettings(TypedDict, total=False):
    """`model.init_args.guide` as a mapping. model: the guide (a checkpoint, export folder, hub name or
    `pkg:` module, or `self`); pooler: its pooler when it is a plain model (as `sentemb evaluate
    --pooler`; e.g. `avg` for all-MiniLM-L6-v2); margin (default 0.0 for a model, GISTEmbed's; −0.1 for
    `self`, Qwen3-Embedding's "+ 0.1") and margin_strategy: the threshold below the positive's score;
    threshold: a fixed threshold instead (DCLR's φ); ties: whether a candidate scoring exactly the
    threshold stays, `kept` (default) or `dropped` (default with `threshold`: DCLR's "≥ φ");
    drop_duplicates: also drop a candidate whose text is the positive's (default true)."""

    model: str
    pooler: str | None
    margin: float
    margin_strategy: MarginStrategy
    threshold: float | None
    ties: Ties
    drop_duplicates: bool


GuideOption = GuideSettings | Literal["self"] | None
GUIDE_DEFAULTS: dict[str, Any] = {"pooler": None, "margin": None, "margin_strategy": "absolute", "threshold": None,
                                  "ties": None, "drop_duplicates": True}
QWEN3_MARGIN = -0.1  # Qwen3-Embedding masks what scores above the positive's score + 0.1
OPTION = "model.init_args.guide"


def guide_settings(option: GuideOption | str) -> GuideSettings | None:
    """The option with its defaults filled in (a bare string is the model); a bad key or value is one
    line naming it."""
    if option is None:
        return None
    if isinstance(option, str):
        option = {"model": option}
    if not isinstance(option, Mapping):
        raise SentEmbUserError(f"{OPTION}: give self, a model, or {{model: M, margin: 0.0, margin_strategy: "
                               f"absolute}}; got {option!r}")
    unknown = sorted(set(option) - {"model", *GUIDE_DEFAULTS})
    if unknown or "model" not in option:
        raise SentEmbUserError(f"{OPTION}: {'unknown key(s) ' + ', '.join(unknown) if unknown else 'no model'}; "
                               f"give model (a model or self) and optionally {', '.join(GUIDE_DEFAULTS)}")
    settings = {**GUIDE_DEFAULTS, **option}
    fixed = settings["threshold"] is not None
    if fixed and (settings["margin"] is not None or settings["margin_strategy"] != "absolute"):
        raise SentEmbUserError(f"{OPTION}: threshold (a fixed score, DCLR's) replaces the margin below the positive's "
                               "score; give one of threshold and margin")
    if settings["margin"] is None and not fixed:
        settings["margin"] = QWEN3_MARGIN if settings["model"] == "self" else 0.0
    if settings["ties"] is None:
        settings["ties"] = "dropped" if fixed else "kept"
    choices = {"margin_strategy": MARGIN_STRATEGIES, "ties": TIES, "drop_duplicates": (True, False)}
    for key, allowed in choices.items():
        if settings[key] not in allowed:
            raise SentEmbUserError(f"{OPTION}.{key} must be {' or '.join(map(str, allowed))}, got {settings[key]!r}")
    for key in ("margin", "threshold"):
        value = settings[key]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise SentEmbUserError(f"{OPTION}.{key} must be a number, got {settings[key]!r}")
    return settings


def guide_reads_text(option: GuideOption) -> bool:
    """Whether the batches need their rows' texts: a guide other than the method itself."""
    settings = guide_settings(option)
    return settings is not None and settings["model"] != "self"


class Guide:
    """The guide's embeddings of a batch's rows and the negatives they drop."""

    def __init__(self, settings: GuideSettings) -> None:
        self.settings = settings
        self.is_self = settings["model"] == "self"
        self._model: LightningModule | None = None

    @classmethod
    def from_option(cls, option: GuideOption) -> Guide | None:
        settings = guide_settings(option)
        return None if settings is None else cls(settings)

    def model(self, device: torch.device) -> LightningModule:
        """The guide model on `device`, frozen and in eval mode (loaded on the first call)."""
        if self._model is None:
            self._model = load_method(self.settings["model"], self.settings["pooler"]).requires_grad_(False)
        if self._model.device != device:
            self._model.to(device)
        return self._model.eval()

    @torch.no_grad()
    def rows(self, embeddings: Tensor, batch: dict[str, Any]) -> Tensor:
        """The guide's embedding of each of `embeddings`' rows (the batch's first views, in order): the rows
        themselves, detached, for `self`; else the guide's embeddings of the rows' texts."""
        if self.is_self:
            return embeddings.detach()
        texts: list[str] = batch["texts"][: embeddings.size(0)]
        position: dict[str, int] = {}
        index = [position.setdefault(text, len(position)) for text in texts]
        model = self.model(embeddings.device)
        features = model.sentence_features(list(position))
        pin = embeddings.device.type == "cuda"  # then the copies to the device do not wait for it
        index_tensor = torch.tensor(index)
        if pin:
            features = {key: value.pin_memory() for key, value in features.items()}
            index_tensor = index_tensor.pin_memory()
        with model.eval_autocast():
            unique = model.embed_features(features).float()
        return unique.index_select(0, index_tensor.to(unique.device, non_blocking=True))

    def drop(
        self, embeddings: Tensor, batch: dict[str, Any], candidate_views: int | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """(n, columns) the negatives the guide drops, for a loss that scores view 0's rows (the anchors)
        against the global batch's rows of views 1, 2, ... in that order (SimCSE's positives then hard
        negatives); and the fraction dropped, to log. `candidate_views`: how many of those views the loss
        reads (None: all); the guide embeds only those (SNCSE's negations, which its InfoNCE never reads,
        are not embedded). Under DDP the guide's rows (and the rows' keys) are gathered as the method
        gathers its own, so column j is the same row for both."""
        read = batch["num_views"] if candidate_views is None else 1 + candidate_views
        rows = embeddings.size(0) // batch["num_views"] * read
        views = self.rows(embeddings[:rows], batch).unflatten(0, (read, -1))
        candidates = torch.cat([gather_with_grad(view) for view in views[1:]])
        keys = None
        if self.settings["drop_duplicates"]:
            if "row_keys" not in batch:
                raise SentEmbUserError(f"{OPTION}.drop_duplicates: the batch has no row_keys; a collator of your own "
                                       "calls `self.add_guide_texts(batch, rows)` (docs/negatives.md), or set it false")
            key_views = batch["row_keys"][:rows].to(embeddings.device).unflatten(0, (read, -1))
            keys = torch.cat([gather_with_grad(view) for view in key_views[1:]])
        s = self.settings
        mask = false_negative_mask(views[0], candidates, local_labels(views.size(1), views.device), s["margin"],
                                   s["margin_strategy"], s["ties"], s["threshold"], keys)
        return mask, {"guide/masked_fraction": masked_fraction(mask)}
