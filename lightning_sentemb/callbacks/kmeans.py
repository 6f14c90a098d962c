"""In-batch K-means centroids for ClusterNS (Deng et al., 2023, §3.3 and Algorithm 1).

The tensor ops are pure torch functions; `CentroidState` is the module the method owns (so
checkpoints and device moves carry the centroids), and `KMeansCallback` drives it after every
training batch: initialize once the batch is spread out enough (σ), then a momentum update.

Differences from the reference implementation (github.com/djz233/ClusterNS), on purpose:

- the centroids are buffers created at construction; the reference creates its parameter at
  the first clustering step, so earlier checkpoints lack it and resume breaks;
- the initialization starts from sample 0 of the global batch instead of `random.randint`
  (the batch is shuffled, so the distribution is the same, and every rank agrees without RNG);
- the update default is the paper's mean of members (Eq. 7-8); the reference's sum of members
  is the `rule="sum"` option;
- the centroids are updated after the optimizer step from the batch that was just trained on,
  so the loss at step t sees the centroids updated through step t-1 (the reference updates
  with batch t first, then builds the loss): one γ-weighted update of lag;
- DDP (the reference runs on one process): rank 0's centroids are the truth, the ones checkpointed.
  Until clustering starts, the σ decision is rank 0's, broadcast and read by the host every step
  (one read a step, until then only); the initial centroids are rank 0's, broadcast. Afterwards
  every rank updates from the same all-gathered batch and assignment rule, which keeps the ranks
  equal wherever their GPUs compute alike, and rank 0's centroids are broadcast again at every log
  step (`log_every_n_steps`), so ranks that round differently (mixed GPU models, nondeterministic
  kernels) drift for at most that many steps.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from lightning_sentemb.distributed import at_decision_step, broadcast_from_rank_zero
from lightning_sentemb.encoders.started import StartedOnce
from lightning_sentemb.losses.info_nce import cosine_matrix
from lightning_sentemb.precision import exact_fp32

__all__ = [
    "Assignment",
    "CentroidState",
    "KMeansCallback",
    "assign",
    "global_initial_centroids",
    "initial_centroids",
    "random_assign",
    "should_initialize",
    "spherical_kmeans",
    "update_centroids",
]

UpdateRule = Literal["mean", "sum"]


class Assignment(NamedTuple):
    """Cluster assignment of a batch: ids of the nearest and second-nearest centroid, and the
    (N, K) sample-to-centroid cosine similarities they were read from."""

    nearest: Tensor
    second_nearest: Tensor
    sims: Tensor


def initial_centroids(embeddings: Tensor, k: int) -> Tensor:
    """Heuristic initialization (§3.3): each new centroid is the not-yet-chosen sample least
    similar (cosine) to the one chosen last.

    The chain starts at sample 0. The reference starts at `random.randint`; the global batch is
    shuffled, so sample 0 is a random sample too, and every rank picks the same one. The
    reference measures similarity between the anchor view and the positive view (z1 vs z2); here
    one view is compared with itself. Returns the chosen rows (raw, not normalized, as the
    reference) as a new (k, H) tensor.
    """
    n = embeddings.shape[0]
    if k > n:
        raise ValueError(
            f"K={k} is larger than the global batch ({n} samples): the centroids are initialized "
            "from distinct batch samples, so lower K or raise the batch size."
        )
    embeddings = embeddings.detach()
    sims = cosine_matrix(embeddings, embeddings)
    taken = torch.zeros(n, dtype=torch.bool, device=embeddings.device)
    # `last` stays a 1-element device tensor and is used through index_select / index_fill_
    # (Python indexing would sync): the chain runs without a host round-trip per centroid.
    last = torch.zeros(1, dtype=torch.long, device=embeddings.device)
    chosen = [last]
    for _ in range(1, k):
        taken.index_fill_(0, last, True)
        last = sims.index_select(0, last).masked_fill(taken, float("inf")).argmin(dim=-1)
        chosen.append(last)
    return embeddings.index_select(0, torch.cat(chosen))


def assign(embeddings: Tensor, centroids: Tensor) -> Assignment:
    """Assign each sample to its most similar centroid (cosine); also return the second most
    similar one, which is ClusterNS's hard negative (§3.2)."""
    sims = cosine_matrix(embeddings.detach(), centroids)
    top2 = sims.topk(2, dim=-1).indices
    return Assignment(top2[:, 0], top2[:, 1], sims)


def random_assign(embeddings: Tensor, centroids: Tensor, seed: int, step: int) -> Assignment:
    """Random clusters (the Table 2 ablation "repl. random clusters"): uniform cluster ids and a
    different uniform "second-nearest" id per sample.

    Seeded by (seed, step): every rank draws the same, and a resumed run continues the same
    sequence. (The loss and the centroid update share one draw: the callback updates with the
    assignment the loss used.)
    """
    n, k = embeddings.shape[0], centroids.shape[0]
    generator = torch.Generator(device=embeddings.device).manual_seed(seed * 2**32 + step)
    nearest = torch.randint(k, (n,), generator=generator, device=embeddings.device)
    shift = torch.randint(1, k, (n,), generator=generator, device=embeddings.device)
    return Assignment(nearest, (nearest + shift) % k, cosine_matrix(embeddings.detach(), centroids))


@torch.no_grad()
def update_centroids(
    centroids: Tensor,
    embeddings: Tensor,
    assignment: Tensor,
    gamma: float | Tensor,
    rule: UpdateRule = "mean",
) -> Tensor:
    """Momentum update of the clusters that have members in the batch, in place:
    c_k <- (1 - γ) c_k + γ t_k. `gamma` may be a device scalar (0 makes it a no-op without a
    host-side branch).

    `rule="mean"` (paper, Eq. 7-8): t_k is the mean of the members of cluster k.
    `rule="sum"` (reference code, `kmeans_optim="momentum"`): t_k is the *sum* of the members,
    so the step grows with the cluster's size (the reference's `kmeans_lr` values were tuned so).
    In both, a cluster with no member in the batch keeps its centroid.

    The member sums are a one-hot matmul rather than `index_add_`: on CUDA `index_add_` adds with
    atomics in no fixed order, and ranks that must hold identical centroids would drift apart.
    No host round-trip.
    """
    if rule not in ("mean", "sum"):
        raise ValueError(f"rule must be 'mean' or 'sum', got {rule!r}")
    k = centroids.shape[0]
    members = (assignment[:, None] == torch.arange(k, device=assignment.device)).to(centroids.dtype)
    with exact_fp32(centroids.device.type):  # the centroids' dtype (fp32) even under autocast
        sums = members.T @ embeddings.detach().to(centroids.dtype)  # (K, H)
    counts = members.sum(dim=0)[:, None]  # (K, 1)
    target = sums / counts.clamp(min=1) if rule == "mean" else sums
    return centroids.lerp_(target, gamma * (counts > 0).to(centroids.dtype))


def should_initialize(embeddings: Tensor, sigma: float) -> Tensor:
    """σ criterion of §5.2: start clustering once the average cosine similarity between distinct
    samples of the batch has dropped to σ.

    The diagonal (each sample with itself, always 1) is excluded, so the threshold does not depend
    on the batch size. The reference averages its z1-vs-z2 matrix including the diagonal of
    positive pairs, which raises its average by about (cos(x, x+) - average) / N (< 0.004 at
    N = 256). Returns a bool scalar tensor (no host sync here).
    """
    n = embeddings.shape[0]
    x = F.normalize(embeddings.detach().float(), dim=-1)
    total = x.sum(dim=0).square().sum()  # sum of all N^2 pairwise cosines
    off_diagonal = (total - x.square().sum()) / (n * (n - 1))
    return off_diagonal <= sigma


def spherical_kmeans(embeddings: Tensor, k: int, seed: int = 0, niter: int = 20) -> tuple[Tensor, Tensor]:
    """Spherical (cosine) K-means on the embeddings' device, in torch: `k` distinct rows drawn with `seed`
    start as the centroids (as faiss's `Kmeans`), then `niter` rounds of Lloyd's algorithm: each row to its
    most similar centroid, each centroid to the normalized mean of its members (a cluster left empty keeps
    its centroid). Similarities in fp32 (`cosine_matrix`); deterministic, no host sync.

    Returns the unit-norm centroids (K, H) and each row's cluster id (N,) under them.
    """
    if k > embeddings.shape[0]:
        raise ValueError(f"K={k} is larger than the number of embeddings ({embeddings.shape[0]}).")
    x = F.normalize(embeddings.detach().float(), dim=-1)
    first = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))[:k]
    if x.device.type == "cuda":  # a pageable host-to-device copy waits for the device
        first = first.pin_memory()
    centroids = x.index_select(0, first.to(x.device, non_blocking=True))
    for _ in range(niter):
        update_centroids(centroids, x, cosine_matrix(x, centroids).argmax(dim=1), gamma=1.0)
        centroids = F.normalize(centroids, dim=-1)
    return centroids, cosine_matrix(x, centroids).argmax(dim=1)


def global_initial_centroids(embeddings: Tensor, k: int, seed: int = 0, niter: int = 20) -> Tensor:
    """Global initialization (Appendix E.2; the paper found it no better, 77.81 vs 77.98):
    spherical K-means (`spherical_kmeans`, on the embeddings' device) over the embeddings of a sample of
    the training set.

    Returns the raw (unnormalized) mean of each cluster's members, i.e. the same space as the
    batch initialization and Eq. 7 means, so the momentum updates mix like with like; a cluster
    left empty keeps its unit-norm K-means centroid. Result is on the device/dtype of `embeddings`.
    """
    centroids, labels = spherical_kmeans(embeddings, k, seed, niter)
    return update_centroids(centroids, embeddings.float(), labels, gamma=1.0).to(dtype=embeddings.dtype)


class CentroidState(StartedOnce):
    """The centroids and their bookkeeping, owned by the method.

    Buffers exist from construction (step 0), so every checkpoint has them and `.to(device)`
    moves them: `centroids` (K, H), `initialized` (bool), `num_updates` (long). `is_initialized`
    is the host's copy of `initialized` (`StartedOnce`), so the training step picks its loss without
    reading the device.

    `random_clusters` (ablation) lives here rather than on the callback because the loss and the
    update use the same assignment: `assign`.
    """

    centroids: Tensor
    num_updates: Tensor

    def __init__(self, k: int, hidden_size: int, random_clusters: bool = False, seed: int = 0) -> None:
        super().__init__()
        if k < 2:
            raise ValueError(f"K must be at least 2 (the hard negative is the second-nearest centroid), got {k}")
        self.k = k
        self.random_clusters = random_clusters
        self.seed = seed
        self.register_buffer("centroids", torch.zeros(k, hidden_size))
        self.register_buffer("num_updates", torch.tensor(0, dtype=torch.long))

    def assign(self, embeddings: Tensor, step: int = 0) -> Assignment:
        """The clusters of a batch: by cosine similarity, or under the ablation random, drawn from
        (seed, `step`)."""
        if self.random_clusters:
            return random_assign(embeddings, self.centroids, self.seed, step)
        return assign(embeddings, self.centroids)

    @torch.no_grad()
    def initialize_(self, centroids: Tensor) -> None:
        self.centroids.copy_(centroids)
        self.mark_initialized()

    @torch.no_grad()
    def update_(self, embeddings: Tensor, assignment: Tensor, gamma: float, rule: UpdateRule = "mean") -> None:
        update_centroids(self.centroids, embeddings, assignment, gamma, rule)
        self.num_updates.add_(1)


class KMeansCallback(Callback):
    """Runs Algorithm 1's clustering after every training batch.

    Reads `pl_module.cluster_state` (a `CentroidState`), `pl_module.last_cluster_embeddings` (the
    global batch of anchor embeddings, all-gathered under DDP) and `pl_module.last_cluster_assignment`
    (their nearest centroids, as the loss assigned them). Before clustering starts it tests the σ
    criterion and, the first time it holds, initializes the centroids from that batch; afterwards it
    updates them with momentum γ. Under DDP rank 0 decides and its centroids are broadcast (see the
    module's docstring): the σ decision costs one host read a step until clustering starts.
    """

    def __init__(self, sigma: float = 0.4, gamma: float = 1e-3, rule: UpdateRule = "mean") -> None:
        if rule not in ("mean", "sum"):
            raise ValueError(f"rule must be 'mean' or 'sum', got {rule!r}")
        self.sigma = sigma
        self.gamma = gamma
        self.rule = rule

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        state: CentroidState = pl_module.cluster_state
        embeddings: Tensor | None = pl_module.last_cluster_embeddings
        if embeddings is None:
            return
        if state.is_initialized:
            state.update_(embeddings, pl_module.last_cluster_assignment, self.gamma, self.rule)
            if at_decision_step(trainer):
                broadcast_from_rank_zero(state.centroids)
        elif bool(broadcast_from_rank_zero(should_initialize(embeddings, self.sigma))):
            state.initialize_(broadcast_from_rank_zero(initial_centroids(embeddings, state.k)))
            rank_zero_info(f"ClusterNS: centroids initialized at global step {trainer.global_step} (σ criterion met)")
