"""ConPVP: anchor with continuous prompt, sampled prototypes, Eq. 1, ablations, one forward, demo fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_sentemb.export import export
from lightning_sentemb.methods.building import build_method
from lightning_sentemb.methods.conpvp import NEGATIVE_TEMPLATES, POSITIVE_TEMPLATES, ConPVP
from tests.test_promptbert import SENTENCES, check_demo_fit, sentence_transformer

MANUAL = 'This sentence : "[X]" means [MASK] .'


@pytest.fixture(scope="module")
def method(tiny_bert: str) -> ConPVP:
    torch.manual_seed(0)
    return build_method(ConPVP, tiny_bert)


def examples(method: ConPVP, sentences: list[str] = SENTENCES) -> list[dict[str, list[int]]]:
    return [{"sent0": ids} for ids in method.encoder.format.sentence_ids(sentences)]


def eq1(v: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor | None, tau: float) -> torch.Tensor:
    """Eq. 1 written out: l_i = -log e^{s(v_i,c+_i)/τ} / Σ_j (e^{s(v_i,c+_j)/τ} + e^{s(v_i,c-_j)/τ})."""
    losses = []
    for i in range(v.size(0)):
        numerator = torch.exp(F.cosine_similarity(v[i], positive[i], dim=0) / tau)
        denominator = sum(torch.exp(F.cosine_similarity(v[i], positive[j], dim=0) / tau) for j in range(v.size(0)))
        if negative is not None:
            denominator = denominator + sum(
                torch.exp(F.cosine_similarity(v[i], negative[j], dim=0) / tau) for j in range(v.size(0))
            )
        losses.append(-torch.log(numerator / denominator))
    return torch.stack(losses).mean()


@pytest.mark.parametrize("prototypes", ["both", "positive"])
def test_loss_is_eq1_on_fixed_tensors(method: ConPVP, prototypes: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(1)
    v, positive, negative = torch.randn(3, 4, 16).unbind(0)
    monkeypatch.setitem(method.hparams, "prototypes", prototypes)
    batch = method.collate(examples(method, SENTENCES + ["a dog runs"]))
    views = [v, positive, negative] if prototypes == "both" else [v, positive]
    assert batch["num_views"] == len(views)
    rows = torch.cat(views)
    monkeypatch.setattr(method, "embed", lambda features: rows)
    loss, _ = method.training_loss(batch)
    torch.testing.assert_close(loss, eq1(v, positive, negative if prototypes == "both" else None, 0.05))


@pytest.mark.parametrize("prompt_init", ["uniform", "normal"])
def test_prompt_initialization(tiny_bert: str, prompt_init: str) -> None:
    torch.manual_seed(0)
    prompt = build_method(ConPVP, tiny_bert, prompt_length=64, prompt_init=prompt_init).encoder.prompt.detach()
    if prompt_init == "uniform":  # the reference's torch.rand
        assert prompt.min() >= 0 and prompt.max() < 1 and abs(float(prompt.mean()) - 0.5) < 0.05
    else:
        assert abs(float(prompt.std()) - 0.02) < 0.002 and abs(float(prompt.mean())) < 0.002


def test_anchor_format_and_sampled_prototype_templates(method: ConPVP, monkeypatch: pytest.MonkeyPatch) -> None:
    fmt = method.encoder.format
    assert [t.text for t in fmt.templates[1:]] == list(POSITIVE_TEMPLATES + NEGATIVE_TEMPLATES)
    anchor = fmt.templates[0]
    ids = fmt.sentence_ids(SENTENCES)[0]
    row = fmt.wrap(ids, None)
    assert row[0] == method.tokenizer.cls_token_id and row[1 : 1 + len(ids)] == ids
    assert anchor.suffix_slots[:4] == [0, 1, 2, 3] and anchor.suffix[4] == method.tokenizer.mask_token_id
    assert method.encoder.prompt.shape == (4, method.encoder.hidden_size)

    calls = []
    build = fmt.build
    monkeypatch.setattr(fmt, "build", lambda *args, **kwargs: calls.append(args) or build(*args, **kwargs))
    method.collate_generator.manual_seed(0)
    method.collate(examples(method) * 20)
    n = 60
    templates = list(calls[0][2])
    assert set(templates[:n]) == {0}
    assert set(templates[n : 2 * n]) <= set(range(1, 9)) and len(set(templates[n : 2 * n])) > 3
    assert set(templates[2 * n :]) <= set(range(9, 17)) and len(set(templates[2 * n :])) > 3


def test_sampling_is_seedable_and_redrawn_every_step(method: ConPVP) -> None:
    method.collate_generator.manual_seed(3)
    first = method.collate(examples(method) * 10)["features"]["input_ids"]
    second = method.collate(examples(method) * 10)["features"]["input_ids"]
    method.collate_generator.manual_seed(3)
    again = method.collate(examples(method) * 10)["features"]["input_ids"]
    assert torch.equal(first, again)
    assert first.shape != second.shape or not torch.equal(first, second)


def test_one_forward_and_gradients_reach_the_prompt(method: ConPVP) -> None:
    calls = []
    # the embedding LayerNorm runs once per backbone forward, padded or padding-free
    handle = method.encoder.backbone.embeddings.LayerNorm.register_forward_hook(lambda *_: calls.append(1))
    batch = method.collate(examples(method))
    loss, _ = method.training_loss(batch)
    handle.remove()
    assert len(calls) == 1
    loss.backward()
    assert method.encoder.prompt.grad is not None and method.encoder.prompt.grad.abs().sum() > 0
    method.zero_grad()


def deterministic_loss(method: ConPVP, seed: int = 0) -> tuple[torch.Tensor, dict]:
    """Loss without dropout, templates drawn from `seed`."""
    method.collate_generator.manual_seed(seed)
    batch = method.collate(examples(method, SENTENCES + ["a dog runs", "an apple falls"]))
    method.eval()
    with torch.no_grad():
        loss, _ = method.training_loss(batch)
    method.train()
    return loss, batch


def test_ablation_without_negative_prototypes_drops_their_terms(
    method: ConPVP, monkeypatch: pytest.MonkeyPatch
) -> None:
    full, batch = deterministic_loss(method)
    monkeypatch.setitem(method.hparams, "prototypes", "positive")
    without, small = deterministic_loss(method)
    assert batch["num_views"] == 3 and small["num_views"] == 2
    # same anchors and positive prototypes (the positive templates are drawn first), fewer negatives
    assert torch.equal(
        small["features"]["input_ids"][:10],
        batch["features"]["input_ids"][:10, : small["features"]["input_ids"].size(1)],
    )
    assert without < full


def test_ablation_without_prototypes_is_prompt_simcse(method: ConPVP, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(method.hparams, "prototypes", "none")
    loss, batch = deterministic_loss(method)
    rows = batch["features"]["input_ids"]
    assert batch["num_views"] == 2 and torch.equal(rows[:5], rows[5:10])
    # without dropout the two views coincide: InfoNCE of the anchors against themselves
    method.eval()
    with torch.no_grad():
        anchors = method.encoder(
            method.encoder.format.build(
                method.encoder.format.sentence_ids(SENTENCES + ["a dog runs", "an apple falls"]), None, denoise=True
            )
        )
    method.train()
    torch.testing.assert_close(loss, eq1(anchors, anchors, None, 0.05), atol=1e-4, rtol=1e-4)


def test_manual_anchor_ablation(tiny_bert: str, method: ConPVP) -> None:
    manual = build_method(ConPVP, tiny_bert, anchor_template=MANUAL)
    assert manual.encoder.prompt is None and "prompt_slots" not in manual.collate(examples(manual))["features"]
    assert manual.encoder.format.templates[0].text == MANUAL
    row = manual.encoder.format.wrap([], None)
    assert manual.tokenizer.convert_ids_to_tokens(row) == [
        "[CLS]",
        "this",
        "sentence",
        ":",
        '"',
        '"',
        "means",
        "[MASK]",
        ".",
        "[SEP]",
    ]


@pytest.mark.parametrize("denoise_test", [False, True])
def test_export_reproduces_encode(tiny_bert: str, denoise_test: bool, tmp_path: Path) -> None:
    torch.manual_seed(0)
    method = build_method(ConPVP, tiny_bert, denoise_test=denoise_test)
    with torch.no_grad():
        method.encoder.prompt.normal_()  # a trained-looking prompt, far from the initialization
    sentences = SENTENCES + ["a much longer sentence about a man who plays the guitar on the street ."]
    expected = method.encode(sentences)
    model = sentence_transformer(export(method, tmp_path / "export"))
    torch.testing.assert_close(model.encode(sentences, convert_to_tensor=True), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_demo_fit(tmp_path: Path, shared_data: Path) -> None:
    check_demo_fit("conpvp.yaml", tmp_path, shared_data)
