"""ClusterNS (Deng et al., 2023): in-batch K-means centroids as hard negatives and a bidirectional
margin loss on the false negatives found by clustering, on top of SimCSE or PromptBERT views.

The clustering half is `ClusteringObjective`, a mixin placed before the view-producing method in
the bases: `ClusterNS(ClusteringObjective, SimCSE)` (non-prompt),
`ClusterNSPrompt(ClusteringObjective, PromptBERT)` (prompt-based) and, beyond the paper,
`ClusterNSPrefix(ClusteringObjective, DCPCSE)` (a frozen backbone steered by deep prefixes). The view
method supplies the encoder, `collate` and `embed`; the mixin supplies the centroid state, the loss,
the K-means callback and the optional global initialization. Tensor ops: `callbacks/kmeans.py`; loss:
`losses/clusterns.py` (their docstrings list the differences from the paper and the reference code).

ConPVP is not a view method for the mixin: its prototypes are its loss (the negative prototypes are
its hard negatives, Eq. 1), which the mixin would replace by ClusterNS's, keeping at most the
positive prototypes — a third method neither paper evaluates.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from ..callbacks.kmeans import Assignment, CentroidState, KMeansCallback, UpdateRule, global_initial_centroids
from ..distributed import broadcast_from_rank_zero, gather_with_grad, local_labels
from ..errors import SentEmbUserError
from ..losses.clusterns import BMLReduction, ClusterNSLoss, FalseNegatives, HardNegatives
from .dcpcse import DCPCSE
from .promptbert import PromptBERT
from .simcse import SimCSE

__all__ = ["ClusterNS", "ClusterNSPrefix", "ClusterNSPrompt", "ClusteringObjective"]


class ClusteringObjective:
    """The ClusterNS objective for any two-view method (SimCSE dropout views, PromptBERT template
    views): mix it in before the method, which provides `collate` and `embed`.

    Training step (Algorithm 1): the anchor view of the global batch (all-gathered under DDP) and
    its assignment to the centroids are kept in `last_cluster_embeddings` / `last_cluster_assignment`
    for `KMeansCallback`, which the method attaches itself (`configure_callbacks`). Before the σ
    criterion holds the loss is the plain InfoNCE; afterwards the loss adds the hard negatives and
    the BML. The callback updates the centroids after the optimizer step, so step t's loss sees the
    centroids updated through step t-1 (the reference updates first: one γ-weighted update of lag).
    The callback reads the σ decision on the host every step until clustering starts (under DDP rank
    0's, broadcast: every rank switches losses at the same step); afterwards nothing is read back.

    Args:
        num_clusters: K. Without global initialization it must not exceed the global batch (the
            centroids start from distinct batch samples).
        sigma: σ, clustering starts once the mean cosine similarity between distinct anchors of
            the batch drops to σ (§5.2).
        gamma: γ, centroid momentum (Eq. 8).
        update_rule: "mean" (paper, Eq. 7) or "sum" (reference code; the published γ values were
            tuned with it).
        hard_negative_weight: μ, factor on the centroid hard negatives in the denominator (Eq. 2).
            Not SimCSE's additive logit bias of the same name: ClusterNS replaces SimCSE's loss.
        bml_weight, bml_alpha, bml_beta: λ, α, β of the bidirectional margin loss (Eq. 4-6).
        hard_negatives: "second_nearest" (paper), "nearest" or "none" (Table 2 ablations).
        false_negatives: "bml" (paper), "mask", "positive" (Table 4) or "none" (Table 2).
        bml_reduction: "all_pairs" (reference; the published λ assume it) or "false_negatives".
        random_clusters: Table 2 "repl. random clusters": random assignments for loss and update.
        global_init_samples: Appendix E.2 "global ClusterNS": at fit start, encode this many
            training examples (a seeded random sample; the whole corpus if larger) and initialize
            the centroids by spherical K-means over them instead of waiting for σ. None = the
            paper's in-batch initialization.
        cluster_seed: seed of the random clusters and of the global initialization's sample and
            K-means.
        **kwargs: see the view method (`SimCSE`, `PromptBERT`) and `SentEmbMethod`.
    """

    mixture_options = frozenset()  # its own loss: no per-dataset negatives

    cluster_state: CentroidState
    last_cluster_embeddings: Tensor | None
    last_cluster_assignment: Tensor | None

    def __init__(
        self,
        backbone: str,
        num_clusters: int = 128,
        sigma: float = 0.4,
        gamma: float = 1e-3,
        update_rule: UpdateRule = "mean",
        hard_negative_weight: float = 1.0,
        bml_weight: float = 1e-3,
        bml_alpha: float = 0.0,
        bml_beta: float = 0.3,
        hard_negatives: HardNegatives = "second_nearest",
        false_negatives: FalseNegatives = "bml",
        bml_reduction: BMLReduction = "all_pairs",
        random_clusters: bool = False,
        global_init_samples: int | None = None,
        cluster_seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(backbone, **kwargs)
        if update_rule not in ("mean", "sum"):
            raise ValueError(f"update_rule must be 'mean' or 'sum', got {update_rule!r}")
        self.loss_fn = ClusterNSLoss(
            self.hparams.temperature, hard_negative_weight, bml_weight, bml_alpha, bml_beta,
            hard_negatives, false_negatives, bml_reduction,
        )
        self.cluster_state = CentroidState(num_clusters, self.output_size, random_clusters, cluster_seed)
        self.last_cluster_embeddings = None
        self.last_cluster_assignment = None

    def configure_callbacks(self) -> list[Callback]:
        """The K-means callback with this method's σ, γ and rule, so a config needs only the model."""
        kmeans = KMeansCallback(self.hparams.sigma, self.hparams.gamma, self.hparams.update_rule)
        return [*super().configure_callbacks(), kmeans]

    def assign_clusters(self, embeddings: Tensor, batch: dict[str, Any]) -> Assignment | None:
        """The K-means assignment of the global batch's anchor view (None until clustering starts), kept
        (`last_cluster_*`) for the callback's update."""
        if batch["num_views"] != 2:
            raise ValueError(
                f"{type(self).__name__} is unsupervised (two views of each sentence); got {batch['num_views']} "
                "views: train on a one-sentence-a-line corpus"
            )
        all_anchors = gather_with_grad(embeddings.unflatten(0, (2, -1))[0].detach())
        state = self.cluster_state
        clusters = state.assign(all_anchors, self.global_step) if state.is_initialized else None
        self.last_cluster_embeddings = all_anchors
        self.last_cluster_assignment = None if clusters is None else clusters.nearest
        return clusters

    def prepare_truncations(self, embeddings: Tensor, batch: dict[str, Any]) -> dict[str, Any]:
        """Matryoshka: the clusters are found once, at full size, and shared by every truncation; the
        K-means state (centroids, their updates) stays full-size, and each truncation's loss sees the
        centroids truncated like the embeddings (re-normalized by the cosine)."""
        return {**batch, "clusters": self.assign_clusters(embeddings, batch)}

    def embedding_loss(
        self, embeddings: Tensor, batch: dict[str, Any], drop: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        clusters = batch["clusters"] if "clusters" in batch else self.assign_clusters(embeddings, batch)
        anchors, positives = embeddings.unflatten(0, (2, -1))
        positives = gather_with_grad(positives)
        labels = local_labels(anchors.size(0), anchors.device)
        state = self.cluster_state
        if clusters is None:  # plain InfoNCE (Eq. 1) until the σ criterion starts clustering
            loss, stats = self.loss_fn(anchors, positives, labels, drop=drop)
        else:
            centroids = state.centroids[:, : anchors.size(-1)]  # all of them unless Matryoshka truncates
            loss, stats = self.loss_fn(anchors, positives, labels, centroids, clusters.nearest, clusters.second_nearest,
                                       drop)
        stats["cluster/initialized"] = state.initialized.float()
        return loss, stats

    def on_train_start(self) -> None:
        """Fail early when K cannot be initialized from a batch; run the global initialization
        when asked (not on resume: the checkpoint's centroids are kept)."""
        super().on_train_start()
        trainer = self.trainer
        if self.hparams.global_init_samples is None:
            batch_size = getattr(trainer.train_dataloader, "batch_size", None)
            if batch_size is not None and self.cluster_state.k > batch_size * trainer.world_size:
                raise ValueError(
                    f"K={self.cluster_state.k} is larger than the global batch ({batch_size} x "
                    f"{trainer.world_size} devices): the centroids are initialized from distinct batch "
                    "samples, so lower num_clusters or raise the batch size (or use global_init_samples)."
                )
        elif not self.cluster_state.is_initialized:
            self.initialize_globally()

    @torch.no_grad()
    def initialize_globally(self) -> None:
        """Appendix E.2: encode a sample of the training set as the anchor view (training mode:
        dropout and the training MLP, the space the batches are clustered in), spherical K-means over it on
        rank 0, and broadcast the centroids so every rank starts identical. Every rank runs the same
        forwards (each a collective under FSDP; under DDP the others would wait for rank 0's anyway), and
        rank 0's embeddings are the ones clustered.

        Each example goes through `collate`, so the prompt variant gets its templates; the second
        view is computed and dropped (twice the cost of one view, once per run).
        """
        trainer = self.trainer
        centroids = torch.empty_like(self.cluster_state.centroids)  # rank 0's, once broadcast
        dataset = trainer.train_dataloader.dataset
        generator = torch.Generator().manual_seed(self.hparams.cluster_seed)
        order = torch.randperm(len(dataset), generator=generator)[: self.hparams.global_init_samples].tolist()
        size = self.hparams.eval_batch_size
        chunks = []
        with trainer.precision_plugin.forward_context():
            for start in range(0, len(order), size):
                batch = self.collate([dataset[i] for i in order[start : start + size]])
                features = {k: v.to(self.device) for k, v in batch["features"].items()}
                chunks.append(self.embed(features).unflatten(0, (batch["num_views"], -1))[0].float())
        if trainer.is_global_zero:
            centroids = global_initial_centroids(torch.cat(chunks), self.cluster_state.k, self.hparams.cluster_seed)
            rank_zero_info(f"ClusterNS: centroids initialized by global K-means over {len(order)} training examples")
        self.cluster_state.initialize_(broadcast_from_rank_zero(centroids))


class ClusterNS(ClusteringObjective, SimCSE):
    """Non-prompt ClusterNS: SimCSE's dropout views (`collate`, pooler, training-only MLP) with the
    clustering objective. See `ClusteringObjective` for the arguments.

    Defaults are the paper's (`update_rule: mean`, Eq. 7); the code sums the members, stops after 3
    validations without a better STS-B dev and clips to norm 1.0: its seed-row configs set those
    (`update_rule: sum`, an EarlyStopping callback; docs/methods.md, reproduction configs)."""


class ClusterNSPrompt(ClusteringObjective, PromptBERT):
    """Prompt-based ClusterNS: PromptBERT's two-template [MASK] views (with template denoising)
    with the clustering objective. See `ClusteringObjective` and `PromptBERT` for the arguments.
    Seed-row configs as `ClusterNS`'s, with PromptBERT's code's dev denoising and template order."""


class ClusterNSPrefix(ClusteringObjective, DCPCSE):
    """ClusterNS on a prefix-tuned frozen backbone: DCPCSE's dropout views through deep prefixes
    (`collate`, prefix encoder, optional MLM loss, trainable-only checkpoints, which keep the
    centroids) with the clustering objective. No paper evaluates it; the configs combine the two
    papers' settings. See `ClusteringObjective` and `DCPCSE` for the arguments; DCPCSE's supervised
    hinge term does not apply (the clustering loss replaces DCPCSE's)."""

    def __init__(self, backbone: str, hinge_weight: float = 0.0, **kwargs: Any) -> None:
        if hinge_weight:
            raise SentEmbUserError(
                "model.init_args.hinge_weight: ClusterNSPrefix is unsupervised and replaces DCPCSE's loss; "
                "remove hinge_weight (it belongs to supervised DCPCSE)"
            )
        super().__init__(backbone, hinge_weight=hinge_weight, **kwargs)
