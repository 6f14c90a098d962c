"""The guide of `model.init_args.guide`: GISTEmbed's false-negative filter for every method.

A guide is any model `sentemb evaluate` reads (checkpoint, export, hub name, `pkg:`), frozen and in
eval mode, or the method itself (`self`, Qwen3-Embedding's recipe: its own detached similarities). Its
cosine similarities between the rows the loss scores decide which negatives leave the denominator
(`losses.guide.false_negative_mask`).

Its inputs: the batch holds the trainee's token ids, which a guide with another tokenizer, template
or length cannot read. The collator decodes each row's ids back to text (`Collator.add_guide_texts`,
in the DataLoader's workers) and the guide tokenizes that text in its own format, as
sentence-transformers' GISTEmbedLoss does when the tokenizers differ. The guide then judges exactly
what the trainee sees (its `max_seq_len` truncation and, for an uncased trainee, lower case), and the
corpus cache stays one tokenization. Each distinct text is embedded once per batch, so identical
texts (the two views of unsupervised SimCSE) get identical guide vectors.

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

from ..distributed import gather_with_grad
from ..errors import SentEmbUserError
from ..loading import load_method
from ..losses.guide import MarginStrategy, false_negative_mask, masked_fraction

__all__ = ["GUIDE_DEFAULTS", "Guide", "GuideOption", "GuideSettings", "guide_reads_text"]


class GuideSettings(TypedDict, total=False):
    """`model.init_args.guide` as a mapping. model: the guide (a checkpoint, export folder, hub name or
    `pkg:` module, or `self`); pooler: its pooler when it is a plain model (as `sentemb evaluate
    --pooler`; e.g. `avg` for all-MiniLM-L6-v2); margin and margin_strategy: GISTEmbed's
    (`losses.guide`)."""

    model: str
    pooler: str | None
    margin: float
    margin_strategy: MarginStrategy


GuideOption = GuideSettings | Literal["self"] | None
GUIDE_DEFAULTS: GuideSettings = {"pooler": None, "margin": 0.0, "margin_strategy": "absolute"}
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
    settings: GuideSettings = {**GUIDE_DEFAULTS, **option}
    if settings["margin_strategy"] not in MarginStrategy.__args__:
        raise SentEmbUserError(f"{OPTION}.margin_strategy must be absolute or relative, "
                               f"got {settings['margin_strategy']!r}")
    if not isinstance(settings["margin"], (int, float)):
        raise SentEmbUserError(f"{OPTION}.margin must be a number, got {settings['margin']!r}")
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
        self._unused_by: str | None = None  # the method whose last batch's rows no loss has read yet

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
    def rows(self, embeddings: Tensor, batch: dict[str, Any], method: str = "the method") -> Tensor:
        """The guide's embedding of each of `embeddings`' rows (the batch's views, in order): the rows
        themselves, detached, for `self`; else the guide's embeddings of the rows' texts. A method whose
        loss never asked for the mask (`drop`) of the previous batch is refused: the guide would do
        nothing, silently."""
        if self._unused_by is not None:
            raise SentEmbUserError(f"{OPTION}: {self._unused_by}.embedding_loss does not apply the guide's mask; a "
                                   "method of your own passes `self.guide.drop(batch, labels)` to its loss "
                                   "(docs/negatives.md), or remove the guide")
        self._unused_by = method
        if self.is_self:
            return embeddings.detach()
        texts: list[str] = batch["texts"]
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

    def drop(self, batch: dict[str, Any], labels: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """(n, columns) the negatives the guide drops, for a loss that scores view 0's rows (the anchors)
        against the global batch's rows of views 1, 2, ... in that order (SimCSE's positives then hard
        negatives); and the fraction dropped, to log. Under DDP the guide's rows are gathered as the
        method gathers its own, so column j is the same row for both."""
        self._unused_by = None
        views = batch["guide_rows"].unflatten(0, (batch["num_views"], -1))
        candidates = torch.cat([gather_with_grad(view) for view in views[1:]])
        mask = false_negative_mask(views[0], candidates, labels, self.settings["margin"],
                                   self.settings["margin_strategy"])
        return mask, {"guide/masked_fraction": masked_fraction(mask)}
