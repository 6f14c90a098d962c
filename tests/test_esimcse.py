"""ESimCSE: word repetition (which tokens repeat, seeded, under both counting rules and both units), the
loss and its gradient against the paper's loss written out (fp64), the momentum encoder and queue
against the reference's step (θm moves toward the step's weights, then embeds the step's anchors with
dropout off, which join the queue after the loss), LoRA's momentum copy holding only the adapters,
gradient caching exact with the same momentum step, and the switches that make it SimCSE again."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.fsdp import LayerFSDPStrategy
from lightning_sentemb.methods import ESimCSE, SimCSE
from lightning_sentemb.methods.building import build_method
from lightning_sentemb.methods.esimcse import repeat_at, repeated_positions
from lightning_sentemb.methods.momentum import EmbeddingQueue
from tests.test_padding_free import without_dropout

SENTENCES = ["the cat sat on the mat", "a dog runs", "kids play football in the park", "the sun shines"]
N, DIM, TAU = 4, 32, 0.05


def examples(method) -> list[dict[str, list[int]]]:
    return [{"sent0": ids} for ids in method.encoder.format.sentence_ids(SENTENCES)]


def positive_tokens(method, seed: int) -> list[list[str]]:
    method.collate_generator.manual_seed(seed)
    rows = method.collate(examples(method)[:2])["features"]["input_ids"][2:]
    return [method.tokenizer.convert_ids_to_tokens([t for t in row.tolist() if t != 0]) for row in rows]


def test_repeat_at_writes_the_chosen_items_twice() -> None:
    assert repeat_at(["the", "cat", "sat"], [0, 2]) == ["the", "the", "cat", "sat", "sat"]
    assert repeat_at([7, 8], []) == [7, 8]


def test_the_positive_repeats_the_drawn_subwords(tiny_bert) -> None:
    """Seeded: each sentence draws dup_len ~ U{0..max(2, ⌊0.32·N⌋)}, then the positions (torch.randperm);
    the hand-read rows of seeds 0 and 4, and the draw replayed for seeds 0-5."""
    method = build_method(ESimCSE, tiny_bert, queue_batches=0)
    assert positive_tokens(method, 0) == [["[CLS]", "the", "cat", "sat", "on", "on", "the", "the", "mat", "[SEP]"],
                                          ["[CLS]", "a", "dog", "dog", "runs", "[SEP]"]]
    assert positive_tokens(method, 4) == [["[CLS]", "the", "the", "cat", "sat", "on", "the", "mat", "[SEP]"],
                                          ["[CLS]", "a", "a", "dog", "dog", "runs", "[SEP]"]]
    words = [s.split() for s in SENTENCES[:2]]
    for seed in range(6):
        generator = torch.Generator().manual_seed(seed)
        expected = []
        for sentence in words:
            count = int(torch.randint(max(2, int(0.32 * len(sentence))) + 1, (1,), generator=generator))
            chosen = set(torch.randperm(len(sentence), generator=generator)[:count].tolist())
            expected.append(["[CLS]", *[w for i, w in enumerate(sentence) for _ in range(1 + (i in chosen))], "[SEP]"])
        assert positive_tokens(method, seed) == expected, seed
    anchors = method.collate(examples(method)[:2])["features"]["input_ids"][:2]
    assert method.tokenizer.batch_decode(anchors, skip_special_tokens=True) == SENTENCES[:2]  # view 0: unrepeated


def test_word_repetition_repeats_whole_words(tiny_bert) -> None:
    method = build_method(ESimCSE, tiny_bert, queue_batches=0, dup_unit="word", dup_rule="reference")
    method.collate_generator.manual_seed(0)
    rows = method.collate([{"sent0": ids} for ids in method.encoder.format.sentence_ids(["unbelievable things"] * 8)])
    texts = method.tokenizer.batch_decode(rows["features"]["input_ids"][8:], skip_special_tokens=True)
    # two words: the reference draws 0 or 1 repetition, never of the last word
    assert set(texts) == {"unbelievable things", "unbelievable unbelievable things"}


@pytest.mark.parametrize(("rule", "unit", "length", "counts", "last"), [
    ("paper", "subword", 12, {0, 1, 2, 3}, 11),  # max(2, ⌊3.84⌋) = 3
    ("paper", "subword", 3, {0, 1, 2}, 2),  # max(2, 0) = 2
    ("paper", "subword", 1, {0, 1}, 0),  # at most the sentence
    ("reference", "subword", 12, {0, 1, 2, 3}, 11),  # ⌊0.32·(12 + 2)⌋ = 4, randrange(4)
    ("reference", "subword", 3, {0}, 2),  # ⌊0.32·5⌋ = 1: randrange(1)
    ("reference", "subword", 40, set(range(10)), 39),  # capped at 10
    ("reference", "word", 12, {0, 1, 2}, 10),  # min(10, 12, max(2, 3)) = 3; never the last word
    ("reference", "word", 2, {0, 1}, 0),
])
def test_each_rule_draws_the_count_and_positions_it_says(rule, unit, length, counts, last) -> None:
    generator = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(600):
        positions = repeated_positions(length, 0.32, rule, unit, 2, generator)
        assert positions == sorted(set(positions)) and all(0 <= p <= last for p in positions)
        seen.add(len(positions))
    assert seen == counts
    assert repeated_positions(length, 0.0, rule, unit, 2, generator) == []  # dup_rate 0: off


def independent_loss(anchors, positives, keys) -> torch.Tensor:
    """The paper's loss written out: -log e^{s(h_i,h_i⁺)/τ} / (Σ_j e^{s(h_i,h_j⁺)/τ} + Σ_m e^{s(h_i,q_m)/τ})."""
    def e(anchor, other):
        return torch.exp(F.cosine_similarity(anchor, other, dim=-1) / TAU)

    terms = []
    for i, anchor in enumerate(anchors):
        denominator = sum(e(anchor, p) for p in positives) + sum(e(anchor, q) for q in keys)
        terms.append(-torch.log(e(anchor, positives[i]) / denominator))
    return torch.stack(terms).mean()


def test_loss_and_gradient_equal_the_papers_equation(tiny_bert) -> None:
    """A queue of 5 with 3 filled (the 2 empty rows stay out of the denominator), fp64."""
    method = build_method(ESimCSE, tiny_bert, queue_size=5).double()
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(3, DIM, generator=generator, dtype=torch.float64)
    method.queue.allocate(5, "queue_size")
    method.queue.push(keys)
    embeddings = torch.randn(2 * N, DIM, generator=generator, dtype=torch.float64, requires_grad=True)
    loss, _ = method.embedding_loss(embeddings, {"num_views": 2})
    (grad,) = torch.autograd.grad(loss, embeddings)
    reference = embeddings.detach().clone().requires_grad_()
    want = independent_loss(reference[:N], reference[N:], keys)
    (want_grad,) = torch.autograd.grad(want, reference)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-6)


def test_the_guide_drops_in_batch_negatives_and_keeps_the_queue(tiny_bert) -> None:
    """A self-guide: sentence 1 duplicates sentence 0, so each of the two anchors drops the other's positive
    (the same text as its own positive: Qwen3-Embedding's duplicate rule, by the rows' keys; its score rule
    drops nothing here), and nothing else; the queue's keys stay negatives."""
    method = build_method(ESimCSE, tiny_bert, queue_size=5, guide="self").double().eval()  # eval: no momentum step
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(3, DIM, generator=generator, dtype=torch.float64)
    method.queue.allocate(5, "queue_size")
    method.queue.push(keys)
    anchors = torch.randn(N, DIM, generator=generator, dtype=torch.float64)
    positives = anchors + 0.1 * torch.randn(N, DIM, generator=generator, dtype=torch.float64)
    anchors[1], positives[1] = anchors[0], positives[0]  # sentence 1 is sentence 0 again
    row_keys = torch.arange(2 * N)
    row_keys[N + 1] = row_keys[N]  # positive 1's text is positive 0's
    loss, logs = method.sentence_loss(torch.cat([anchors, positives]), {"num_views": 2, "row_keys": row_keys})
    assert float(logs["guide/masked_fraction"]) == pytest.approx(2 / (N * (N - 1)))  # of the negatives
    dropped = {0: 1, 1: 0}
    kept = [[i, *(j for j in range(N) if j not in (i, dropped.get(i)))] for i in range(N)]  # own positive first
    terms = [independent_loss(anchors[i : i + 1], positives[kept[i]], keys) for i in range(N)]
    want = torch.stack(terms).mean()
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)


def momentum_method(path: str, **kwargs):
    torch.manual_seed(0)
    method = without_dropout(build_method(ESimCSE, path, queue_size=10, momentum=0.9, **kwargs)).double()
    method.log = lambda *args, **kw: None
    return method


def test_momentum_encoder_and_queue_follow_the_reference_step(tiny_bert) -> None:
    """Three steps of 4 anchors into a queue of 10: θm ← 0.9·θm + 0.1·θ_t with the step's weights (before the
    optimizer step), keys = MLP(encoder with θm, dropout off)(anchors), pushed after the loss, which reads
    the steps before (step 0: none). The keys are recomputed on a copy of the encoder holding θm."""
    method = momentum_method(tiny_bert)
    optimizer = torch.optim.SGD([p for p in method.parameters() if p.requires_grad], lr=0.5)
    names = method.momentum_encoder.names
    average = {n: p.detach().clone() for n, p in method.encoder.named_parameters() if n in names}
    pushed = []
    for step in range(3):
        method.collate_generator.manual_seed(step)
        batch = method.collate(examples(method))
        with torch.no_grad():
            embeddings = method.embed(batch["features"])
        want = independent_loss(embeddings[:N], embeddings[N:], torch.cat(pushed) if pushed else torch.empty(0, DIM))
        loss, _ = method.step_loss(batch)
        torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
        current = dict(method.encoder.named_parameters())
        average = {n: 0.9 * average[n] + 0.1 * current[n].detach() for n in names}
        shadow = copy.deepcopy(method.encoder).eval()
        with torch.no_grad():
            for name, parameter in shadow.named_parameters():
                if name in average:
                    parameter.copy_(average[name])
            anchors = {k: v[:N] for k, v in batch["features"].items()}
            pushed.append(method.mlp(shadow(anchors)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, tensor in zip(names, method.momentum_encoder.averages(), strict=True):
        torch.testing.assert_close(tensor, average[name], rtol=1e-12, atol=1e-12)
    queue = method.queue
    assert int(queue.filled) == 10 and queue.capacity == 10
    torch.testing.assert_close(queue.embeddings, torch.cat(pushed)[-10:], rtol=1e-10, atol=1e-12)


def test_gradient_caching_is_exact_and_takes_the_same_momentum_step(tiny_bert) -> None:
    method = momentum_method(tiny_bert)
    method.collate_generator.manual_seed(0)
    batch = method.collate(examples(method))
    method.step_loss(batch)  # a first step fills the queue
    cached = copy.deepcopy(method)
    loss, _ = method.step_loss(batch)
    loss.backward()
    cached.hparams.grad_cache_chunk = 3
    cached_loss, _ = cached.grad_cache_backward(batch)
    torch.testing.assert_close(cached_loss, loss.detach(), rtol=1e-12, atol=0)
    for (name, p), q in zip(method.named_parameters(), cached.parameters(), strict=True):
        if p.requires_grad:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-12, msg=name)
    for name, tensor in method.named_buffers():
        torch.testing.assert_close(dict(cached.named_buffers())[name], tensor, rtol=1e-12, atol=1e-12, msg=name)


def test_fresh_momentum_encoder_is_the_architectures_initialization(tiny_bert) -> None:
    """`momentum_init: fresh` (the reference's re-initialized copy): LayerNorm 1 and 0, biases 0, linear and
    embedding weights N(0, initializer_range²) drawn anew; the encoder keeps its pretrained weights and
    "copy" starts from them."""
    torch.manual_seed(0)
    fresh = build_method(ESimCSE, tiny_bert, queue_size=10, momentum_init="fresh")
    copied = build_method(ESimCSE, tiny_bert, queue_size=10)
    std = fresh.encoder.backbone.config.initializer_range
    encoder = dict(fresh.encoder.named_parameters())
    for name, tensor in zip(fresh.momentum_encoder.names, fresh.momentum_encoder.averages(), strict=True):
        assert torch.equal(dict(copied.encoder.named_parameters())[name], encoder[name])
        module = fresh.encoder.get_submodule(name.rpartition(".")[0])
        if isinstance(module, torch.nn.LayerNorm):
            assert torch.all(tensor == (1.0 if name.endswith("weight") else 0.0)), name
        elif name.endswith("bias"):
            assert not tensor.any(), name
        else:
            assert not torch.equal(tensor, encoder[name]), name
            bound = 4 * std / tensor.numel() ** 0.5  # four standard errors of the sample's mean and std
            assert abs(float(tensor.std()) - std) < bound and abs(float(tensor.mean())) < bound, name
    for name, tensor in zip(copied.momentum_encoder.names, copied.momentum_encoder.averages(), strict=True):
        assert torch.equal(tensor, encoder[name]), name
    with pytest.raises(SentEmbUserError, match="momentum_init must be one of copy, fresh"):
        build_method(ESimCSE, tiny_bert, momentum_init="random")


def test_lora_momentum_copy_is_the_adapters_alone(tiny_bert) -> None:
    lora = {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear"}
    method = momentum_method(tiny_bert, lora=lora)
    trained = [n for n, p in method.encoder.named_parameters() if p.requires_grad]
    assert method.momentum_encoder.names == trained and all(".lora_" in n for n in trained)
    averaged = sum(t.numel() for t in method.momentum_encoder.averages())
    assert averaged < sum(p.numel() for p in method.encoder.backbone.parameters()) / 10
    method.collate_generator.manual_seed(0)
    method.step_loss(method.collate(examples(method)))
    kept = method.trainable_state_keys()  # what a checkpoint of a frozen backbone keeps
    assert {"queue.embeddings", "queue.filled"} <= kept
    assert {f"momentum_encoder.{name.replace('.', '__')}" for name in trained} <= kept


def test_without_repetition_and_queue_it_is_simcse(tiny_bert) -> None:
    torch.manual_seed(0)
    esimcse = without_dropout(build_method(ESimCSE, tiny_bert, dup_rate=0.0, queue_batches=0))
    torch.manual_seed(0)  # the same MLP
    simcse = without_dropout(build_method(SimCSE, tiny_bert))
    batch = esimcse.collate(examples(esimcse))
    features = batch["features"]["input_ids"]
    assert torch.equal(features[:N], features[N:]) and esimcse.momentum_encoder is None
    simcse_batch = simcse.collate(examples(simcse))
    torch.testing.assert_close(esimcse.training_loss(batch)[0], simcse.training_loss(simcse_batch)[0])


def test_bad_settings_and_fsdp_are_one_line(tiny_bert) -> None:
    with pytest.raises(SentEmbUserError, match="dup_rule must be one of paper, reference"):
        build_method(ESimCSE, tiny_bert, dup_rule="code")
    with pytest.raises(SentEmbUserError, match="0 <= momentum < 1"):
        build_method(ESimCSE, tiny_bert, momentum=1.0)
    queue = EmbeddingQueue(DIM)
    queue.allocate(10, "model.init_args.queue_size")
    with pytest.raises(SentEmbUserError, match="model.init_args.queue_size: the checkpoint's queue holds 10"):
        queue.allocate(20, "model.init_args.queue_size")
    method = build_method(ESimCSE, tiny_bert)
    method._trainer = SimpleNamespace(state=SimpleNamespace(fn="fit"), precision="bf16-mixed", gradient_clip_val=None,
                                      accumulate_grad_batches=1, strategy=LayerFSDPStrategy())
    with pytest.raises(SentEmbUserError, match="model.init_args.queue_batches: ESimCSE's momentum encoder needs"):
        method.configure_callbacks()
    restored = EmbeddingQueue(DIM)
    restored.load_state_dict(queue.state_dict())  # a checkpoint brings its capacity
    assert restored.capacity == 10
