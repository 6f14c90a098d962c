"""BERT-flow: the Glow's log-likelihood equals an independent fp64 implementation of the reference's
equations and autograd's Jacobian; its data-dependent start; the method trains the flow alone on a
frozen backbone (fp32 under bf16 autocast), refuses what cannot train it, and exports a folder that
sentence-transformers and `sentemb evaluate` serve as `encode` does."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_sentemb.encoders.glow import ActNorm, Glow, LUMixing, ZeroLinear, normal_log_prob
from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.methods import BERTFlow
from lightning_sentemb.methods.building import build_method

SENTENCES = ["a man is playing a guitar .", "the cat sat .", "this sentence means something rather long , really .",
             "two dogs run across the field today .", "nice .", "a woman is slicing an onion on the table ."]
SHAPES = [("additive", "reverse"), ("affine", "lu")]


def random_glow(coupling: str, mixing: str, dim: int = 8) -> Glow:
    """A 2-level, 2-step flow in fp64 with every parameter random (its zero-started layers too)."""
    torch.manual_seed(0)
    glow = Glow(dim, levels=2, depth=2, coupling_width=4, coupling=coupling, mixing=mixing).double()
    with torch.no_grad():
        for module in glow.modules():
            if isinstance(module, (ActNorm, ZeroLinear)):
                for parameter in module.parameters():
                    parameter.normal_(std=0.3)
            if isinstance(module, LUMixing):
                module.lower.normal_(std=0.3)
                module.upper.normal_(std=0.3)
    return glow


def reference_flow(glow: Glow, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The reference's `encoder_decoder` + `top_prior` on a 1×1 image, written out from its ops in numpy fp64:
    (latent [eps₀, …, z], log p(x))."""
    p = {name: value.detach().numpy() for name, value in glow.state_dict().items()}
    objective, latents = np.zeros(len(x)), []

    def actnorm(prefix: str, h: np.ndarray) -> tuple[np.ndarray, float]:
        logs = p[f"{prefix}.logs"] * 3.0
        return (h + p[f"{prefix}.bias"]) * np.exp(logs), logs.sum()

    relu = lambda h: np.maximum(h, 0)  # noqa: E731
    for level, steps in enumerate(glow.levels):
        for s, step in enumerate(steps):
            key = f"levels.{level}.{s}"
            x, logdet = actnorm(f"{key}.actnorm", x)
            objective += logdet
            if step.mixing.__class__.__name__ == "LUMixing":
                m = f"{key}.mixing"
                channels = x.shape[1]
                lower = np.tril(p[f"{m}.lower"], -1) + np.eye(channels)
                upper = np.triu(p[f"{m}.upper"], 1) + np.diag(p[f"{m}.sign_s"] * np.exp(p[f"{m}.log_s"]))
                x = x @ (p[f"{m}.p"] @ lower @ upper)
                objective += p[f"{m}.log_s"].sum()
            else:
                x = x[:, ::-1]
            n = f"{key}.coupling.net"
            x1, x2 = np.split(x, 2, axis=1)
            h = relu(actnorm(f"{n}.0.actnorm", x1 @ p[f"{n}.0.linear.weight"].T)[0])
            h = relu(actnorm(f"{n}.2.actnorm", h @ p[f"{n}.2.linear.weight"].T)[0])
            out = (h @ p[f"{n}.4.weight"].T + p[f"{n}.4.bias"]) * np.exp(p[f"{n}.4.logs"] * 3.0)
            if step.coupling.affine:
                scale = 1 / (1 + np.exp(-(out[:, 1::2] + 2.0)))
                x2 = (x2 + out[:, 0::2]) * scale
                objective += np.log(scale).sum(1)
            else:
                x2 = x2 + out
            x = np.concatenate([x1, x2], axis=1)
        if level < len(glow.levels) - 1:
            x, leaving = np.split(x, 2, axis=1)
            objective += (-0.5 * (leaving**2 + np.log(2 * np.pi))).sum(1)
            latents.append(leaving)
    objective += (-0.5 * (x**2 + np.log(2 * np.pi))).sum(1)
    return np.concatenate([*latents, x], axis=1), objective


@pytest.mark.parametrize(("coupling", "mixing"), SHAPES)
def test_log_likelihood_equals_the_reference_equations_and_autograds_jacobian(coupling, mixing):
    glow = random_glow(coupling, mixing)
    x = torch.randn(3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    latent, log_likelihood = glow(x)
    want_latent, want = reference_flow(glow, x.numpy())
    np.testing.assert_allclose(latent.detach().numpy(), want_latent, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(log_likelihood.detach().numpy(), want, rtol=1e-6, atol=1e-6)
    for row in x:  # change of variables: log p(x) = log N(f(x)) + log |det ∂f/∂x|
        jacobian = torch.autograd.functional.jacobian(lambda v: glow(v[None])[0][0], row)
        expected = normal_log_prob(glow(row[None])[0])[0] + torch.linalg.slogdet(jacobian).logabsdet
        torch.testing.assert_close(glow(row[None])[1][0], expected, rtol=1e-10, atol=1e-10)


def test_the_first_batch_starts_every_actnorm_and_the_flow_starts_as_a_permutation():
    """The reference's data-dependent init: each actnorm's output over the batch has mean 0 and RMS 1;
    the couplings start as the identity (zero last layer), so the latent is x normalized and reordered."""
    torch.manual_seed(0)
    glow = Glow(8, levels=2, depth=2, coupling_width=4).double()
    x = torch.randn(64, 8, dtype=torch.float64) * torch.arange(1, 9) + 3.0
    glow.initialize_(x)
    assert bool(glow.initialized)
    first = glow.levels[0][0].actnorm(x)[0]
    torch.testing.assert_close(first.mean(0), torch.zeros(8, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(first.pow(2).mean(0).sqrt(), torch.ones(8, dtype=torch.float64), atol=1e-5, rtol=0)
    inner = glow.levels[0][0].coupling.net[0]
    hidden = inner.actnorm(inner.linear(first.flip(-1)[:, :4]))[0]
    torch.testing.assert_close(hidden.mean(0), torch.zeros(4, dtype=torch.float64), atol=1e-12, rtol=0)
    latent = glow(x)[0]
    assert torch.allclose(latent.pow(2).mean(0), torch.ones(8, dtype=torch.float64), atol=1e-4)


def flow_method(path: str, **kwargs) -> BERTFlow:
    method = build_method(BERTFlow, path, pooler="avg", dropout=0.0, flow_levels=2, flow_depth=2,
                          flow_coupling_width=4, **kwargs)
    method.log = method.log_dict = lambda *args, **kw: None
    return method


def test_the_method_fits_the_flow_alone_on_the_frozen_backbone(tiny_bert):
    method = flow_method(tiny_bert).train()
    assert method.backbone_frozen and not any(p.requires_grad for p in method.encoder.parameters())
    batch = method.collate([{"sent0": ids} for ids in method.encoder.format.sentence_ids(SENTENCES)])
    loss, _ = method.step_loss(batch)
    assert method.flow.is_initialized and bool(method.flow.initialized)
    with torch.no_grad():  # the first batch started the flow: the same batch through it, by hand
        pooled = method.encoder(batch["features"])
        log_likelihood = method.flow(pooled)[1]
    torch.testing.assert_close(loss, -log_likelihood.mean() / (32 * math.log(2)))
    loss.backward()
    assert all(p.grad is None for p in method.encoder.parameters())
    assert all(p.grad is not None for p in method.flow.parameters() if p.requires_grad)
    assert method.trainable_state_keys() == {f"flow.{k}" for k in method.flow.state_dict()}
    half = pooled.bfloat16()  # what a bf16 backbone pools
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the flow in fp32 under autocast
        mixed = method.project(half)
    assert mixed.dtype == torch.float32 and torch.equal(mixed, method.project(half.float()))


@pytest.mark.parametrize(("option", "value"), [("mlp", "train"), ("grad_cache_chunk", 2), ("mlm_weight", 0.1),
                                               ("matryoshka_dims", [16]), ("lora", {"r": 2})])
def test_what_cannot_train_the_flow_is_refused_in_one_line(option, value, tiny_bert):
    with pytest.raises(SentEmbUserError, match=f"model.init_args.{option}: BERTFlow trains its flow alone") as refusal:
        BERTFlow(tiny_bert, **{option: value})
    assert "\n" not in str(refusal.value)
    with pytest.raises(SentEmbUserError, match="flow_levels 6.*divisible by 2\\*\\*levels"):
        BERTFlow(tiny_bert, flow_levels=6)


def test_a_first_batch_with_a_constant_dimension_stops_the_fit_in_one_line(tiny_bert):
    """No maximum of the likelihood there: the actnorm's 1e6 scale would compound over the steps."""
    method = flow_method(tiny_bert)
    pooled = torch.randn(8, 32)
    pooled[:, 5] = 0.25
    with pytest.raises(SentEmbUserError, match="BERTFlow: 1 of the 32 pooled dimensions of .* are constant over the "
                                               "first batch") as refusal:
        method.start_flow(pooled)
    assert "\n" not in str(refusal.value) and not method.flow.is_initialized
    method.start_flow(torch.randn(8, 32))
    assert method.flow.is_initialized


def test_export_serves_the_flow_through_sentence_transformers_and_evaluate(tiny_bert, tmp_path):
    from sentence_transformers import SentenceTransformer

    from lightning_sentemb.export import export
    from lightning_sentemb.loading import load_embedder

    method = flow_method(tiny_bert, flow_coupling="affine", flow_mixing="lu").train()
    optimizer = torch.optim.AdamW([p for p in method.parameters() if p.requires_grad], lr=1e-2)
    batch = method.collate([{"sent0": ids} for ids in method.encoder.format.sentence_ids(SENTENCES)])
    for _ in range(2):
        loss, _ = method.step_loss(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    folder = export(method.eval(), tmp_path / "export")
    want = method.encode(SENTENCES)
    model = SentenceTransformer(str(folder), device="cpu", trust_remote_code=True)
    torch.testing.assert_close(model.encode(SENTENCES, convert_to_tensor=True), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(load_embedder(str(folder)).encode(SENTENCES), want, atol=1e-5, rtol=1e-5)


def test_labelled_pairs_are_two_sentences_a_pair_as_the_reference_reads_them(tiny_bert):
    """A batch of labelled NLI pairs (`allnli_pairs.csv`) is its premises then its hypotheses, 2 rows a pair
    (the reference's 32 pairs: 64 sentences), the label unused; SimCSE's NLI csv gives every column."""
    method = flow_method(tiny_bert)
    ids = method.encoder.format.sentence_ids(SENTENCES[:4])
    pairs = method.collate([{"premise": ids[0], "hypothesis": ids[1], "label": 0},
                            {"premise": ids[2], "hypothesis": ids[3], "label": 2}])
    want = method.encoder.format.build([ids[0], ids[2], ids[1], ids[3]], max_length=None)
    assert pairs["num_views"] == 2 and torch.equal(pairs["features"]["input_ids"], want["input_ids"])
    triples = method.collate([{"sent0": ids[0], "sent1": ids[1], "hard_neg": ids[2]}])
    assert triples["num_views"] == 3 and triples["features"]["input_ids"].size(0) == 3
    method.collator.check_columns(["premise", "hypothesis", "label"], "allnli_pairs.csv")  # a corpus it reads
    with pytest.raises(SentEmbUserError, match="x.csv: the corpus has no column sent0"):
        method.collator.check_columns(["text"], "x.csv")


def test_the_flow_knows_on_the_host_whether_it_started_and_a_checkpoint_says_so(tiny_bert):
    """The Glow's host copy of `initialized` (`StartedOnce`): set by its start, and read back from a loaded
    state dict, so the training step branches on it without reading the device (nor starting the flow twice)."""
    started = flow_method(tiny_bert)
    started.start_flow(torch.randn(8, 32))
    fresh = flow_method(tiny_bert)
    assert not fresh.flow.is_initialized
    fresh.load_state_dict(started.state_dict())
    assert fresh.flow.is_initialized and all(torch.equal(a, b) for a, b in zip(
        fresh.flow.state_dict().values(), started.flow.state_dict().values(), strict=True))
    fresh.load_state_dict(flow_method(tiny_bert).state_dict())  # an unstarted flow's checkpoint
    assert not fresh.flow.is_initialized
