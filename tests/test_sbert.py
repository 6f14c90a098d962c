"""SBERT: its loss equals sentence-transformers' `SoftmaxLoss` on the same weights (fp64: value and
gradients); the labelled NLI pairs read alike from a csv and from SentEval's NLI layout, with one line
for a bad label or unequal files; options that cannot apply are refused."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from transformers import AutoTokenizer

from lightning_sentemb.data.corpus import open_tokenized_corpus, tokenize_corpus
from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.methods import SBERT
from lightning_sentemb.methods.building import build_method

PAIRS = [("a man plays a guitar .", "a man plays music .", "entailment"),
         ("the cat sleeps .", "the cat is awake .", "contradiction"),
         ("kids play football .", "kids play in the park .", "neutral"),
         ("a woman cooks .", "a woman is in the kitchen .", "entailment")]


class Embeddings(nn.Module):
    """A sentence-transformers model that returns the embeddings it is given."""

    device = torch.device("cpu")

    def forward(self, features: dict) -> dict:
        return {"sentence_embedding": features["embedding"]}


@pytest.mark.parametrize("multiplication", [False, True])
def test_loss_equals_sentence_transformers_softmax_loss(tiny_bert: str, multiplication: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from sentence_transformers.losses import SoftmaxLoss
    method = build_method(SBERT, tiny_bert, concatenation_sent_multiplication=multiplication).double()
    fmt = method.encoder.format
    batch = method.collate([{"premise": p, "hypothesis": h, "label": label} for p, h, label in
                            zip(fmt.sentence_ids([p for p, _, _ in PAIRS]), fmt.sentence_ids([h for _, h, _ in PAIRS]),
                                [0, 2, 1, 0], strict=True)])
    embeddings = method.embed(batch["features"]).detach().requires_grad_()
    ours, _ = method.embedding_loss(embeddings, batch)
    our_grads = torch.autograd.grad(ours, [embeddings, *method.loss_fn.classifier.parameters()])

    theirs_fn = SoftmaxLoss(Embeddings(), method.output_size, 3, concatenation_sent_multiplication=multiplication)
    theirs_fn.classifier.load_state_dict(method.loss_fn.classifier.state_dict())
    theirs_fn.double()
    u, v = embeddings.unflatten(0, (2, -1))
    theirs = theirs_fn([{"embedding": u}, {"embedding": v}], batch["labels"])
    their_grads = torch.autograd.grad(theirs, [embeddings, *theirs_fn.classifier.parameters()])
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    for got, want in zip(our_grads, their_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_csv_and_sentevals_layout_read_alike(tiny_bert: str, tmp_path) -> None:
    folder = tmp_path / "SNLI"
    folder.mkdir()
    for split, rows in (("dev", PAIRS[:3]), ("test", PAIRS[3:])):  # no train split, as the mirror's
        for part, column in (("s1", 0), ("s2", 1), ("labels", 2)):
            (folder / f"{part}.{split}").write_text("".join(f"{row[column]} \n" for row in rows))
    csv = tmp_path / "pairs.csv"
    csv.write_text("label,premise,hypothesis,genre\n" + "".join(f"{label},{p},{h},x\n" for p, h, label in PAIRS))
    tokenizer = AutoTokenizer.from_pretrained(tiny_bert)
    read = [open_tokenized_corpus(tokenize_corpus(path, tokenizer, 16, tmp_path / "cache", workers=1))
            for path in (folder, csv)]
    assert read[0].column_names == read[1].column_names == ["premise", "hypothesis", "label"]
    assert read[0][:] == read[1][:] and read[0]["label"] == [0, 2, 1, 0]

    csv.write_text("premise,hypothesis,label\na,b,entailment\nc,d,-\n")
    with pytest.raises(SentEmbUserError, match=r"pairs.csv: row 3 has label '-'; labels are entailment, neutral, "):
        tokenize_corpus(csv, tokenizer, 16, tmp_path / "cache", workers=1)
    (folder / "labels.test").write_text("entailment\nneutral\n")
    with pytest.raises(SentEmbUserError, match="s1.test, s2.test, labels.test have different numbers of lines"):
        tokenize_corpus(folder, tokenizer, 16, tmp_path / "cache", workers=1)


def test_what_sbert_refuses(tiny_bert: str) -> None:
    method = build_method(SBERT, tiny_bert)
    with pytest.raises(SentEmbUserError, match="the corpus has no column premise, hypothesis, label"):
        method.collator.check_columns(["sent0"], "wiki.txt")
    for option, value in (("guide", "self"), ("matryoshka_dims", [16, 8])):
        with pytest.raises(SentEmbUserError, match=f"model.init_args.{option}: not for SBERT"):
            build_method(SBERT, tiny_bert, **{option: value})


@pytest.mark.parametrize("method_class", ["SBERT", "ConSERTJoint"])
def test_both_nli_classifiers_read_the_four_concatenation_options(tiny_bert: str, method_class: str) -> None:
    """SBERT and supervised ConSERT build their classifier the one way (`NLISoftmaxLoss.from_options`): every
    switch it reads is an option of both, and each reaches it (u, v and u * v here: 3 vectors of 32)."""
    import inspect

    from lightning_sentemb import methods
    from lightning_sentemb.losses.nli_softmax import CONCATENATIONS

    cls = getattr(methods, method_class)
    assert set(CONCATENATIONS) <= set(inspect.signature(cls.__init__).parameters)
    switches = dict(zip(CONCATENATIONS, (True, False, True, False), strict=True))
    method = build_method(cls, tiny_bert, **switches)
    assert method.loss_fn.parts == (True, False, True, False)
    assert method.loss_fn.classifier.in_features == 3 * 32
