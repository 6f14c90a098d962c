"""Alignment and uniformity (Wang & Isola, 2020) of the embedding space, logged at each validation."""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn

from ..data.senteval import StsTask, load_sts_task
from ..evaluation.analysis import alignment_uniformity, encode_pairs

__all__ = ["EmbeddingSpaceMonitor"]


class EmbeddingSpaceMonitor(Callback):
    """Logs `val/alignment` and `val/uniformity` at each validation of a fit, as the `analysis`
    evaluator computes them: the method's `encode_across_ranks` (every rank encodes a share and computes
    the same scores) on an STS set's pairs, alignment over the pairs
    whose gold score is above `positive_threshold`, uniformity over all distinct sentences. Lower is
    better for both; a collapsing run shows alignment falling to 0 while uniformity rises to 0.

    Args:
        task: STS set (SentEval name) whose pairs are encoded; STS-B dev, which the run reads anyway.
        positive_threshold: gold score above which a pair is a positive (4 on STS-B, as SimCSE and
            ClusterNS).
    """

    def __init__(self, task: str = "STSBenchmark-dev", positive_threshold: float = 4.0) -> None:
        self.task = task
        self.positive_threshold = positive_threshold
        self._pairs: StsTask | None = None

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        if self._pairs is None:
            self._pairs = load_sts_task(self.task, trainer.datamodule.data_dir)
        pairs, label = self._pairs, f"{self.task}: alignment, uniformity"
        first, second, distinct = encode_pairs(
            lambda sentences: pl_module.encode_across_ranks(sentences, label=label).numpy(),
            pairs.first, pairs.second,
        )
        scores = alignment_uniformity(first, second, pairs.gold, distinct, positive_threshold=self.positive_threshold)
        for key in ("alignment", "uniformity"):
            pl_module.log(f"val/{key}", float(scores[key]), sync_dist=False)  # the same on every rank
