"""SNCSE the method: its three views (the sentence under templates 0 and 1, its negation under template 1),
its loss on them equal to the paper's equations, and the one line for a corpus without negations."""

from __future__ import annotations

import pytest
import torch

from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.methods import SNCSE
from lightning_sentemb.methods.building import build_method
from tests.losses.test_sncse import ALPHA, BETA, LAMBDA, TAU, paper_loss

SENTENCES = ["a man is playing a guitar .", "the cat sleeps", "kids play football in the park", "a woman cooks"]
NEGATIONS = ["a man is not playing a guitar .", "Not the cat sleeps", "kids do not play football in the park",
             "a woman does not cook"]


def examples(method: SNCSE) -> list[dict[str, list[int]]]:
    ids = method.encoder.format.sentence_ids
    return [{"sent0": s, "negation": n} for s, n in zip(ids(SENTENCES), ids(NEGATIONS), strict=True)]


def test_views_and_loss(tiny_bert: str) -> None:
    method = build_method(SNCSE, tiny_bert, bml_weight=LAMBDA, bml_alpha=ALPHA, bml_beta=BETA, temperature=TAU)
    assert not method.hparams.denoise_train  # the reference does not denoise
    fmt = method.encoder.format
    batch = method.collate(examples(method))
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(batch["features"]["input_ids"],
                                                             batch["features"]["attention_mask"], strict=True)]
    sentences, negations = fmt.sentence_ids(SENTENCES), fmt.sentence_ids(NEGATIONS)
    assert rows == ([fmt.wrap(s, None, 0) for s in sentences] + [fmt.wrap(s, None, 1) for s in sentences]
                    + [fmt.wrap(n, None, 1) for n in negations])
    method.double()
    embeddings = method.embed(batch["features"])
    loss, logs = method.embedding_loss(embeddings, batch)
    anchors, positives, soft = embeddings.unflatten(0, (3, -1))
    torch.testing.assert_close(loss, paper_loss(anchors, positives, soft, list(range(4))), rtol=1e-6, atol=1e-6)
    assert set(logs) == {"loss/info_nce", "loss/bml", "sim/positive", "sim/soft_negative"}


def test_a_corpus_without_negations_is_one_line(tiny_bert: str) -> None:
    method = build_method(SNCSE, tiny_bert)
    with pytest.raises(SentEmbUserError) as refusal:
        method.collator.check_columns(["sent0"], "corpus.txt")
    message = str(refusal.value)
    assert message.startswith("corpus.txt: the corpus has no column negation (it has sent0)")
    assert "sentemb data negate" in message and "data.negate" in message and "\n" not in message


def test_a_guide_filters_the_infonce_positives_only(tiny_bert: str) -> None:
    """GISTEmbed's mask covers every later view; SNCSE's InfoNCE reads the positives' columns of it."""
    method = build_method(SNCSE, tiny_bert, guide={"model": "self", "margin": 1.0})  # drops every negative
    method.log_dict = lambda *args, **kwargs: None
    loss, logs = method.step_loss(method.collate(examples(method)))
    assert float(logs["guide/masked_fraction"]) > 0
    assert float(logs["loss/info_nce"]) < 1e-6  # each anchor's positive is all that is left
