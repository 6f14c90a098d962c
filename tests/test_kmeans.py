"""In-batch K-means of ClusterNS: hand-computed updates, initialization, assignment, σ
criterion, state/checkpoint behaviour, the callback inside a real Trainer, and no host syncs."""

from __future__ import annotations

import math
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sentemb.callbacks.kmeans import (
    CentroidState,
    KMeansCallback,
    assign,
    global_initial_centroids,
    initial_centroids,
    random_assign,
    should_initialize,
    spherical_kmeans,
    update_centroids,
)

CENTROIDS = torch.tensor([[1.0, 0.0], [0.0, 2.0], [-3.0, -3.0]])
EMBEDDINGS = torch.tensor([[2.0, 0.0], [4.0, 2.0], [0.0, 6.0], [6.0, -2.0]])
ASSIGNMENT = torch.tensor([0, 0, 1, 0])  # cluster 2 has no member


def test_update_mean_rule_matches_hand_computation():
    centroids = CENTROIDS.clone()
    update_centroids(centroids, EMBEDDINGS, ASSIGNMENT, gamma=0.1, rule="mean")
    mean0 = torch.tensor([(2 + 4 + 6) / 3, (0 + 2 - 2) / 3])  # (4, 0)
    expected = torch.stack(
        [
            0.9 * CENTROIDS[0] + 0.1 * mean0,  # (1.3, 0.0)
            0.9 * CENTROIDS[1] + 0.1 * EMBEDDINGS[2],  # (0.0, 2.4)
            CENTROIDS[2],  # empty: unchanged
        ]
    )
    torch.testing.assert_close(centroids, expected)
    torch.testing.assert_close(centroids[0], torch.tensor([1.3, 0.0]))


def test_update_sum_rule_matches_reference_formula():
    # Reference (kmeans_optim="momentum"): c <- (1 - lr) c + lr * sum(members), empty kept.
    centroids = CENTROIDS.clone()
    update_centroids(centroids, EMBEDDINGS, ASSIGNMENT, gamma=0.1, rule="sum")
    expected = torch.stack(
        [
            0.9 * CENTROIDS[0] + 0.1 * torch.tensor([12.0, 0.0]),
            0.9 * CENTROIDS[1] + 0.1 * EMBEDDINGS[2],
            CENTROIDS[2],
        ]
    )
    torch.testing.assert_close(centroids, expected)


def test_update_is_in_place_and_detached():
    centroids = CENTROIDS.clone()
    pointer = centroids.data_ptr()
    embeddings = EMBEDDINGS.clone().requires_grad_()
    out = update_centroids(centroids, embeddings, ASSIGNMENT, gamma=0.5)
    assert out is centroids and centroids.data_ptr() == pointer
    assert not centroids.requires_grad and centroids.grad_fn is None


def test_update_all_empty_but_one_and_gamma_one_is_plain_mean():
    centroids = CENTROIDS.clone()
    update_centroids(centroids, EMBEDDINGS, torch.full((4,), 1), gamma=1.0)
    torch.testing.assert_close(centroids[1], EMBEDDINGS.mean(dim=0))
    torch.testing.assert_close(centroids[[0, 2]], CENTROIDS[[0, 2]])


def test_update_rejects_unknown_rule():
    with pytest.raises(ValueError, match="rule"):
        update_centroids(CENTROIDS.clone(), EMBEDDINGS, ASSIGNMENT, 0.1, "median")  # type: ignore[arg-type]


def _at_angles(degrees: list[float], norms: list[float]) -> Tensor:
    rad = torch.tensor(degrees) * math.pi / 180
    return torch.stack([torch.cos(rad), torch.sin(rad)], dim=1) * torch.tensor(norms)[:, None]


def test_initialization_chain_picks_least_similar_to_last():
    # Angles 0, 90, 180, 45, 200 degrees (norms differ: only cosine matters, raw rows returned).
    # From sample 0 (0°): least similar is 180° (#2). From 180°, among {90°, 45°, 200°}:
    # cosines 0, -0.71, 0.94 -> 45° (#3). From 45°, among {90°, 200°}: 0.71, -0.91 -> 200° (#4).
    embeddings = _at_angles([0, 90, 180, 45, 200], [1.0, 2.0, 3.0, 0.5, 4.0])
    centroids = initial_centroids(embeddings, k=4)
    torch.testing.assert_close(centroids, embeddings[[0, 2, 3, 4]])
    centroids[0] += 1  # a copy, not a view of the batch
    assert embeddings[0, 0] == 1.0


def test_initialization_never_repeats_a_sample():
    embeddings = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    centroids = initial_centroids(embeddings, k=16)
    rows = [int((embeddings == c).all(dim=1).nonzero()) for c in centroids]
    assert sorted(rows) == list(range(16)) and rows[0] == 0


def test_k_larger_than_batch_is_a_clear_error():
    with pytest.raises(ValueError, match=r"K=5 is larger than the global batch \(4 samples\)"):
        initial_centroids(EMBEDDINGS, k=5)


def test_assign_nearest_and_second_nearest_by_cosine():
    centroids = _at_angles([0, 90, 180, 270], [5.0, 1.0, 1.0, 1.0])
    embeddings = _at_angles([10, 80, 200, 300], [1.0, 1.0, 1.0, 9.0])
    result = assign(embeddings, centroids)
    assert result.nearest.tolist() == [0, 1, 2, 3]
    assert result.second_nearest.tolist() == [1, 0, 3, 0]
    expected = F.normalize(embeddings, dim=-1) @ F.normalize(centroids, dim=-1).T
    torch.testing.assert_close(result.sims, expected)


def test_random_assign_is_seeded_and_valid():
    embeddings, centroids = torch.randn(64, 4), torch.randn(5, 4)
    first = random_assign(embeddings, centroids, seed=3, step=7)
    again = random_assign(embeddings, centroids, seed=3, step=7)
    other = random_assign(embeddings, centroids, seed=3, step=8)
    assert torch.equal(first.nearest, again.nearest) and torch.equal(first.second_nearest, again.second_nearest)
    assert not torch.equal(first.nearest, other.nearest)
    assert (first.nearest != first.second_nearest).all()
    assert first.nearest.min() >= 0 and first.nearest.max() < 5 and first.second_nearest.max() < 5


def test_sigma_criterion_excludes_the_diagonal():
    # Orthogonal rows: every distinct pair has cosine 0; with the diagonal the mean would be 1/3.
    embeddings = torch.eye(3) * torch.tensor([[1.0], [2.0], [3.0]])
    assert should_initialize(embeddings, sigma=0.0)
    assert not should_initialize(embeddings, sigma=-0.01)
    # Pairs at 0°, 60°, 120°: cosines 0.5, -0.5, 0.5 -> mean 1/6.
    embeddings = _at_angles([0, 60, 120], [1.0, 1.0, 1.0])
    assert should_initialize(embeddings, sigma=1 / 6 + 1e-6)
    assert not should_initialize(embeddings, sigma=1 / 6 - 1e-6)
    assert should_initialize(embeddings, sigma=0.2).dtype == torch.bool


def test_state_buffers_exist_from_construction():
    state = CentroidState(k=4, hidden_size=3)
    assert set(state.state_dict()) == {"centroids", "initialized", "num_updates"}
    assert state.centroids.shape == (4, 3) and not state.is_initialized
    assert {name for name, _ in state.named_buffers()} == {"centroids", "initialized", "num_updates"}


def test_state_resume_restores_the_host_view():
    state = CentroidState(k=2, hidden_size=2)
    state.initialize_(CENTROIDS[:2])
    state.update_(EMBEDDINGS, torch.tensor([0, 0, 1, 0]), gamma=0.1)
    resumed = CentroidState(k=2, hidden_size=2)
    resumed.load_state_dict(state.state_dict())
    assert resumed.is_initialized and int(resumed.num_updates) == 1
    torch.testing.assert_close(resumed.centroids, state.centroids)


def test_state_k_must_allow_a_second_nearest():
    with pytest.raises(ValueError, match="at least 2"):
        CentroidState(k=1, hidden_size=4)


def test_state_random_clusters_follow_the_step():
    state = CentroidState(k=3, hidden_size=2, random_clusters=True, seed=1)
    state.initialize_(CENTROIDS)
    first = state.assign(EMBEDDINGS, step=4)
    assert torch.equal(first.nearest, state.assign(EMBEDDINGS, step=4).nearest)
    assert torch.equal(first.nearest, random_assign(EMBEDDINGS, CENTROIDS, seed=1, step=4).nearest)
    assert not torch.equal(first.nearest, state.assign(EMBEDDINGS, step=5).nearest)


def test_global_initialization_returns_member_means():
    generator = torch.Generator().manual_seed(0)
    blob_a = torch.tensor([5.0, 0.0, 0.0]) + 0.1 * torch.randn(60, 3, generator=generator)
    blob_b = torch.tensor([0.0, 0.0, 2.0]) + 0.1 * torch.randn(60, 3, generator=generator)
    centroids = global_initial_centroids(torch.cat([blob_a, blob_b]), k=2, seed=0)
    expected = torch.stack([blob_a.mean(dim=0), blob_b.mean(dim=0)])
    if centroids[0, 0] < centroids[1, 0]:
        expected = expected.flip(0)
    torch.testing.assert_close(centroids, expected)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_spherical_kmeans_finds_the_partition_and_centroids_faiss_finds(seed: int):
    """Five separated directions on the sphere (norms and noise vary): the torch K-means and faiss's
    spherical K-means (what the global initialization used before) both recover the generating partition,
    with the same unit centroids (the normalized member means)."""
    import faiss

    generator = torch.Generator().manual_seed(0)
    directions = F.normalize(torch.randn(5, 16, generator=generator), dim=-1)
    truth = torch.arange(5).repeat_interleave(40)
    x = (directions[truth] * (1 + torch.rand(200, 1, generator=generator))
         + 0.1 * torch.randn(200, 16, generator=generator))
    centroids, labels = spherical_kmeans(x, 5, seed=seed)
    unit = F.normalize(x, dim=-1).numpy()
    kmeans = faiss.Kmeans(16, 5, niter=20, seed=seed, spherical=True)
    kmeans.train(unit)
    faiss_labels = torch.from_numpy(kmeans.index.search(unit, 1)[1][:, 0]).long()
    for found in (labels, faiss_labels):  # each found cluster is one generating direction
        assert len(set(zip(found.tolist(), truth.tolist(), strict=True))) == 5 and len(found.unique()) == 5
    faiss_centroids = torch.from_numpy(kmeans.centroids)
    members_mean = torch.stack([F.normalize(torch.from_numpy(unit)[labels == c].mean(0), dim=0) for c in range(5)])
    torch.testing.assert_close(centroids, members_mean, atol=1e-5, rtol=0)
    order = torch.tensor([faiss_labels[labels == c][0].item() for c in range(5)])  # faiss id of our cluster c
    torch.testing.assert_close(centroids, faiss_centroids[order], atol=1e-5, rtol=0)


@contextmanager
def _forbid_host_sync(monkeypatch: pytest.MonkeyPatch):
    """Make every explicit device->host read of a tensor raise."""

    def boom(*args, **kwargs):
        raise AssertionError("host sync")

    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
            patch.setattr(torch.Tensor, name, boom)
        yield


def test_ops_run_without_host_reads(monkeypatch: pytest.MonkeyPatch):
    embeddings = torch.randn(32, 8)
    state = CentroidState(k=4, hidden_size=8)
    with _forbid_host_sync(monkeypatch):
        centroids = initial_centroids(embeddings, k=4)
        state.initialize_(centroids)
        result = state.assign(embeddings)
        state.update_(embeddings, result.nearest, gamma=0.01, rule="mean")
        update_centroids(state.centroids, embeddings, result.nearest, gamma=0.01, rule="sum")
        should_initialize(embeddings, sigma=0.4)
        spherical_kmeans(embeddings, k=4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for sync debug mode")
def test_ops_run_without_cuda_sync():
    embeddings = torch.randn(256, 64, device="cuda")
    state = CentroidState(k=32, hidden_size=64).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        state.initialize_(initial_centroids(embeddings, k=32))
        for random_clusters in (False, True):
            state.random_clusters = random_clusters
            state.update_(embeddings, state.assign(embeddings).nearest, gamma=1e-3)
        should_initialize(embeddings, sigma=0.4)
        spherical_kmeans(embeddings, k=32)
    finally:
        torch.cuda.set_sync_debug_mode(0)


# --- the callback inside a real Trainer -------------------------------------------------------


class _Tiny(LightningModule):
    """Exposes what the callback reads; lr 0 keeps the embeddings fixed for hand checks."""

    def __init__(self, k: int = 3) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 8)
        self.cluster_state = CentroidState(k=k, hidden_size=8)
        self.last_cluster_embeddings: Tensor | None = None
        self.last_cluster_assignment: Tensor | None = None

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        z = self.encoder(batch[0])
        self.last_cluster_embeddings = self.all_gather(z.detach()).reshape(-1, z.shape[-1])
        self.last_cluster_assignment = self.cluster_state.assign(self.last_cluster_embeddings).nearest
        return z.pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _trainer(callback: KMeansCallback, max_steps: int) -> Trainer:
    return Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _batches() -> tuple[TensorDataset, list[Tensor]]:
    data = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    return TensorDataset(data), list(data.split(8))


def test_callback_initializes_then_updates_like_the_ops(tmp_path):
    dataset, batches = _batches()
    model = _Tiny()
    trainer = _trainer(KMeansCallback(sigma=1.0, gamma=0.1, rule="mean"), max_steps=4)
    trainer.fit(model, DataLoader(dataset, batch_size=8, shuffle=False))

    with torch.no_grad():
        embeddings = [model.encoder(batch) for batch in batches]
    expected = initial_centroids(embeddings[0], k=3)
    for batch in embeddings[1:]:
        update_centroids(expected, batch, assign(batch, expected).nearest, gamma=0.1)
    state = model.cluster_state
    assert state.is_initialized and int(state.num_updates) == 3
    torch.testing.assert_close(state.centroids, expected)

    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    resumed = _Tiny()
    resumed.load_state_dict(torch.load(path, weights_only=False)["state_dict"])
    assert resumed.cluster_state.is_initialized and int(resumed.cluster_state.num_updates) == 3
    torch.testing.assert_close(resumed.cluster_state.centroids, expected)


def test_callback_waits_for_sigma():
    dataset, _ = _batches()
    model = _Tiny()
    _trainer(KMeansCallback(sigma=-1.0), max_steps=2).fit(model, DataLoader(dataset, batch_size=8))
    assert not model.cluster_state.is_initialized
    assert not model.cluster_state.centroids.any()
    assert "cluster_state.centroids" in model.state_dict()  # checkpoints before clustering have it


def test_callback_reports_k_larger_than_batch():
    dataset, _ = _batches()
    with pytest.raises(ValueError, match="K=9 is larger than the global batch"):
        _trainer(KMeansCallback(sigma=1.0), max_steps=1).fit(_Tiny(k=9), DataLoader(dataset, batch_size=8))


class _Recording(_Tiny):
    """A DDP run where rank 1 disagrees: its own σ would never start clustering, and its centroids
    are perturbed after step 3 (as a GPU that rounds differently would drift). Checks, on every rank,
    the centroids after each step against rank 0's ops replayed on the global batches seen."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Tensor] = []
        self.centroids_after: list[Tensor] = []

    def on_fit_start(self) -> None:
        """As `SentEmbMethod`: no DDP buffer broadcast before each forward, which would hide what is tested."""
        self.trainer.strategy.model.forward_sync_buffers = False
        self.trainer.strategy.model.broadcast_buffers = False

    def on_train_start(self) -> None:
        if self.global_rank == 1:
            next(c for c in self.trainer.callbacks if isinstance(c, KMeansCallback)).sigma = -1.0

    def on_train_batch_end(self, outputs: Tensor, batch: list[Tensor], batch_idx: int) -> None:
        self.seen.append(self.last_cluster_embeddings)
        if self.global_rank == 1 and self.global_step == 3:
            self.cluster_state.centroids.add_(1e-3)
        self.centroids_after.append(self.cluster_state.centroids.clone())

    def on_train_end(self) -> None:
        assert self.seen[0].shape[0] == 16  # the global batch: 2 ranks x 8
        expected = [initial_centroids(self.seen[0], k=3)]  # rank 0 decides: clustering starts at step 1
        for embeddings in self.seen[1:]:
            expected.append(update_centroids(expected[-1].clone(), embeddings, assign(embeddings, expected[-1]).nearest,
                                             gamma=0.1))
        # every rank checks every rank's history (a failure on rank 1 alone might not reach pytest)
        histories = self.all_gather(torch.stack(self.centroids_after))
        for rank, history in enumerate(histories):
            for step, (got, want) in enumerate(zip(history, expected, strict=True)):
                if rank == 1 and step == 2:  # step 3: perturbed, not yet a log step
                    assert not torch.allclose(got, want)
                else:
                    torch.testing.assert_close(got, want, msg=f"rank {rank} after step {step + 1}")


@pytest.mark.slow
def test_callback_under_ddp_follows_rank_zero():
    """Rank 0's σ decision and initial centroids hold on every rank, and its centroids are broadcast
    at log steps (every 2 here): after step 4 rank 1's drift of step 3 is gone."""
    dataset, _ = _batches()
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_fork",  # the ranks start with this process's imports (spawn re-imports torch)
        max_steps=4,
        log_every_n_steps=2,
        callbacks=[KMeansCallback(sigma=1.0, gamma=0.1)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(_Recording(), DataLoader(TensorDataset(torch.cat([dataset.tensors[0]] * 2)), batch_size=8))
