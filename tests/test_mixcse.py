"""MixCSE: the loss and every gradient against the paper's equation written out (fp64; with and without
stop-gradient, one and three mixed negatives), the reference's layout against its code's computation
(shifted batch, masks that zero a logit, the second block of mixed anchors), the partners (the next ones,
or drawn from (run seed, step) alone: every rank slices one draw, so 2 ranks' losses average to 1 process's),
the settings refused in one line, and the export (sentence-transformers and AutoModel load it)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.losses.mixcse import MixCSELoss, mixing_partners
from lightning_sentemb.methods import MixCSE
from lightning_sentemb.methods.building import build_method
from lightning_sentemb.methods.mixcse import example_order

N, DIM, TAU, LAMBDA = 6, 16, 0.05, 0.2


def leaves(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    anchors = torch.randn(N, DIM, generator=generator, dtype=torch.float64)
    positives = anchors + 0.5 * torch.randn(N, DIM, generator=generator, dtype=torch.float64)
    return anchors.requires_grad_(), positives.requires_grad_()


def cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a @ b) / (a.norm() * b.norm())


def paper_loss(anchors, positives, partners, stop_gradient: bool) -> torch.Tensor:
    """l_i = -log e^{s(h_i,h_i⁺)/τ} / (Σ_j e^{s(h_i,h_j⁺)/τ} + Σ_k e^{s(h_i,h̃_ik)/τ}),
    h̃_ik = (λh_i⁺ + (1-λ)h⁺_{p_ik}) / ‖·‖, sg(h̃) under stop-gradient."""
    terms = []
    for i in range(anchors.size(0)):
        denominator = sum(torch.exp(cos(anchors[i], p) / TAU) for p in positives)
        for j in partners[i].tolist():
            mixed = LAMBDA * positives[i] + (1 - LAMBDA) * positives[j]
            mixed = mixed / mixed.norm()
            denominator = denominator + torch.exp(cos(anchors[i], mixed.detach() if stop_gradient else mixed) / TAU)
        terms.append(-torch.log(torch.exp(cos(anchors[i], positives[i]) / TAU) / denominator))
    return torch.stack(terms).mean()


def loss_and_grads(loss_fn, seed: int = 0) -> tuple[torch.Tensor, ...]:
    anchors, positives = leaves(seed)
    loss = loss_fn(anchors, positives)
    return (loss.detach(), *torch.autograd.grad(loss, (anchors, positives)))


@pytest.mark.parametrize("stop_gradient", [True, False])
@pytest.mark.parametrize("num_mixed", [1, 3])
def test_loss_and_gradients_equal_the_papers_equation(stop_gradient: bool, num_mixed: int) -> None:
    partners = mixing_partners(N, num_mixed, "random", torch.Generator().manual_seed(3), torch.device("cpu"))
    labels = torch.arange(N)
    got = loss_and_grads(lambda a, p: MixCSELoss(LAMBDA, TAU, stop_gradient).paper(a, p, labels, partners))
    want = loss_and_grads(lambda a, p: paper_loss(a, p, partners, stop_gradient))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-9)


def reference_code_loss(z1: torch.Tensor, z2: torch.Tensor) -> torch.Tensor:
    """What mixcse/models_mix.py's cl_forward computes (hard_negative_weight 0), written as it does: the
    batch shifted by one, eye-shifted masks multiplying the logits (so a masked logit is 0), two blocks."""
    sim = F.cosine_similarity
    cos_sim = sim(z1.unsqueeze(1), z2.unsqueeze(0), dim=-1) / TAU
    z3 = torch.cat([z2[1:], z2[:1]], dim=0)
    z3 = (LAMBDA * z2 + (1 - LAMBDA) * z3).detach()
    z1_z3 = sim(z1.unsqueeze(1), z3.unsqueeze(0), dim=-1) / TAU
    mask = torch.eye(N, dtype=z1.dtype)
    z1_z3 = (1 - torch.cat([mask[-1:], mask[:-1]])) * z1_z3
    z4 = torch.cat([z1[1:], z1[:1]], dim=0)
    z4 = (LAMBDA * z1 + (1 - LAMBDA) * z4).detach()
    z4_z2 = sim(z4.unsqueeze(1), z2.unsqueeze(0), dim=-1) / TAU
    z4_z2 = (1 - torch.cat([mask[:, -1:], mask[:, :-1]], dim=1)) * z4_z2
    return F.cross_entropy(torch.cat([cos_sim, z1_z3, z4_z2], dim=1), torch.arange(N))


def test_reference_layout_equals_the_reference_codes_computation() -> None:
    labels = torch.arange(N)
    got = loss_and_grads(lambda a, p: MixCSELoss(LAMBDA, TAU).reference(a, p, a.detach(), labels))
    want = loss_and_grads(reference_code_loss)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-9)


def test_partners_are_other_rows_and_the_draw_is_the_steps() -> None:
    cpu = torch.device("cpu")
    assert mixing_partners(4, 2, "next", None, cpu).tolist() == [[1, 2], [2, 3], [3, 0], [0, 1]]
    drawn = mixing_partners(8, 3, "random", torch.Generator().manual_seed(0), cpu)
    rows = torch.arange(8)[:, None]
    assert (drawn != rows).all() and all(len(set(r)) == 3 for r in drawn.tolist())
    assert torch.equal(drawn, mixing_partners(8, 3, "random", torch.Generator().manual_seed(0), cpu))


def test_the_draw_is_the_steps_alone_so_a_resume_draws_the_same(tiny_bert) -> None:
    """MixCSE keeps no state: step s's partners come from (run seed, s), whatever ran before."""
    method, fresh = build_method(MixCSE, tiny_bert), build_method(MixCSE, tiny_bert)
    cpu = torch.device("cpu")
    first = method.partners(8, cpu)
    method._trainer = fresh._trainer = SimpleNamespace(global_step=3)
    assert not torch.equal(method.partners(8, cpu), first)
    assert torch.equal(method.partners(8, cpu), fresh.partners(8, cpu))


def test_two_ranks_slice_one_draw_and_average_to_one_process(tiny_bert) -> None:
    """Rank r scores its anchors (every 2nd example from r, as the sampler deals them) against the global
    positives in the examples' order with the partners of its rows of the global draw: the mean of the
    ranks' losses and their gradient are the 1-process ones."""
    method = build_method(MixCSE, tiny_bert, num_mixed=2)
    partners = method.partners(N, torch.device("cpu"))
    assert torch.equal(partners, method.partners(N, torch.device("cpu")))  # (run seed, step) alone
    loss = MixCSELoss()
    whole = loss_and_grads(lambda a, p: loss.paper(a, p, torch.arange(N), partners))
    def ranks(anchors, positives):
        parts = [loss.paper(anchors[r::2], positives, labels, partners[labels])
                 for r in range(2) for labels in [torch.arange(N // 2) * 2 + r]]
        assert torch.equal(example_order(2, N // 2, torch.device("cpu")), torch.tensor([0, 3, 1, 4, 2, 5]))
        return sum(parts) / 2

    for g, w in zip(loss_and_grads(ranks), whole, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_the_method_mixes_the_global_batchs_positives(tiny_bert) -> None:
    method = build_method(MixCSE, tiny_bert).double()
    assert method.hparams.mix_with == "random"
    embeddings = torch.randn(2 * N, 32, dtype=torch.float64)
    loss, _ = method.embedding_loss(embeddings, {"num_views": 2})
    partners = method.partners(N, torch.device("cpu"))
    torch.testing.assert_close(loss, paper_loss(embeddings[:N], embeddings[N:], partners, True), rtol=1e-6, atol=0)
    reference = build_method(MixCSE, tiny_bert, mix_layout="reference").double()
    assert reference.hparams.mix_with == "next"
    loss, _ = reference.embedding_loss(embeddings, {"num_views": 2})
    torch.testing.assert_close(loss, reference_code_loss(embeddings[:N], embeddings[N:]), rtol=1e-6, atol=0)


def test_settings_that_cannot_apply_are_one_line(tiny_bert) -> None:
    with pytest.raises(SentEmbUserError, match="mix_layout reference mixes each sentence with the next one"):
        build_method(MixCSE, tiny_bert, mix_layout="reference", num_mixed=2)
    with pytest.raises(SentEmbUserError, match="mix_with must be null or one of random, next"):
        build_method(MixCSE, tiny_bert, mix_with="hardest")
    method = build_method(MixCSE, tiny_bert, num_mixed=6)
    with pytest.raises(SentEmbUserError, match="num_mixed 6: a global batch of 6 has 5 other sentences"):
        method.embedding_loss(torch.randn(2 * N, 32), {"num_views": 2})
    with pytest.raises(SentEmbUserError, match="MixCSE is unsupervised"):
        method.embedding_loss(torch.randn(3 * N, 32), {"num_views": 3})


def test_the_export_loads_in_sentence_transformers_and_automodel(tiny_bert, tmp_path) -> None:
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    from lightning_sentemb.export import export

    sentences = ["a man plays guitar", "the cat sleeps"]
    method = build_method(MixCSE, tiny_bert, pooler="avg").eval()
    folder = export(method, tmp_path / "export")
    model = SentenceTransformer(str(folder), device="cpu")
    torch.testing.assert_close(model.encode(sentences, convert_to_tensor=True), method.encode(sentences),
                               atol=1e-5, rtol=1e-5)
    assert AutoModel.from_pretrained(folder).config.model_type == "bert"


def test_val_mlp_applies_the_mlp_in_validation_only(tiny_bert) -> None:
    """`val_mlp` (the reference's selection): validation reads MLP(pooled), test and `encode` the pooled
    vector; without it validation reads the pooled vector too."""
    sentences = ["a dog runs", "the sun shines"]
    method = build_method(MixCSE, tiny_bert, val_mlp=True).eval()
    with torch.no_grad():
        pooled = method.encoder({k: v for k, v in method.sentence_features(sentences).items()})
        method._trainer = SimpleNamespace(validating=True, sanity_checking=False)
        torch.testing.assert_close(method.encode_batch(sentences), method.mlp(pooled))
        method.hparams.val_mlp = False
        torch.testing.assert_close(method.encode_batch(sentences), pooled)
        method.hparams.val_mlp = True
        method._trainer = SimpleNamespace(validating=False, sanity_checking=False)  # testing
        torch.testing.assert_close(method.encode_batch(sentences), pooled)
        method._trainer = None
        torch.testing.assert_close(method.encode_batch(sentences), pooled)
    with pytest.raises(SentEmbUserError, match="val_mlp validates through the MLP"):
        build_method(MixCSE, tiny_bert, val_mlp=True, mlp="always")


def test_matryoshka_truncations_share_one_draw_of_the_partners(tiny_bert) -> None:
    """The partners are drawn once a step (`prepare_truncations`), not once per truncation, and each
    truncation's loss is the method's loss on it with that draw."""
    method = build_method(MixCSE, tiny_bert, num_mixed=2, matryoshka_dims=[32, 16, 8]).double()
    draws = []
    partners = method.partners
    method.partners = lambda total, device: draws.append(total) or partners(total, device)
    embeddings = torch.randn(2 * N, 32, dtype=torch.float64)
    loss, logs = method.sentence_loss(embeddings, {"num_views": 2})
    assert draws == [N]
    drawn = partners(N, torch.device("cpu"))
    for dim in (32, 16, 8):
        truncated = F.normalize(embeddings[:, :dim], dim=-1)
        want = paper_loss(truncated[:N], truncated[N:], drawn, True)
        torch.testing.assert_close(logs[f"matryoshka/loss_{dim}"], want, rtol=1e-6, atol=0)
