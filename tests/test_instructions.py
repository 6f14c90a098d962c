"""A mixture dataset's instruction before its queries, pooled over the text only (`encoders.instruction`),
and its in-batch negatives turned off (`SimCSE.own_candidates_loss`): the collated rows by hand, the
pooled vectors against an independent masked mean of the backbone's own forward (padded and
padding-free, an encoder and a decoder), the loss and its gradient against a loop over the rows, and
the composition with gradient caching, Matryoshka and the guide."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn
from transformers import AutoModel

from lightning_sentemb.data.instructions import instruction_prefix
from lightning_sentemb.data.mixture import MixtureSource
from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.methods import PromptBERT, SimCSE
from lightning_sentemb.methods.building import build_method
from tests.test_grad_cache import gradients, relative_error

QUERIES = ["a man is playing a guitar .", "the cat sat .", "two dogs run across the field today .", "nice ."]
DOCS = ["someone plays music", "a cat is sitting on the mat", "animals outside", "good"]
NEGATIVES = ["the sea is calm", "nobody plays", "a car drives fast", "bad weather today"]


def source_for(method, instruction: str = "Retrieve a sentence that means the same", **overrides) -> MixtureSource:
    ids = method.tokenizer(instruction_prefix(instruction), add_special_tokens=False)["input_ids"]
    return MixtureSource(index=0, name="nli", instruction_ids=tuple(ids), instruction=instruction, **overrides)


def mixture_examples(method, source: MixtureSource, negatives: bool = True) -> list[dict]:
    ids = {name: method.encoder.format.sentence_ids(texts) for name, texts in
           (("sent0", QUERIES), ("sent1", DOCS), ("hard_neg", NEGATIVES))}
    columns = ("sent0", "sent1", "hard_neg") if negatives else ("sent0", "sent1")
    return [{**{c: ids[c][i] for c in columns}, "mixture": source} for i in range(len(QUERIES))]


def no_dropout(method):
    for module in method.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return method.eval()


def test_the_instruction_goes_before_the_queries_only_and_each_side_is_cut_at_its_length(tiny_bert):
    method = build_method(SimCSE, tiny_bert, pooler="avg")
    source = source_for(method, query_max_len=len(source_for(method).instruction_ids) + 4, doc_max_len=4)
    batch = method.collate(mixture_examples(method, source))
    ids, fmt = batch["features"]["input_ids"], method.encoder.format
    instruction = list(source.instruction_ids)
    query = fmt.sentence_ids(QUERIES[:1])[0]
    assert ids[0, : 4 + len(instruction)].tolist() == fmt.prefix_ids + instruction + query[:2] + fmt.suffix_ids
    doc = fmt.sentence_ids(DOCS[:1])[0]
    assert ids[4, :4].tolist() == fmt.prefix_ids + doc[:2] + fmt.suffix_ids  # no instruction, cut at 4
    assert batch["dataset"] is source
    # the pool mask leaves out [CLS] and the instruction of the queries, nothing of the documents
    mask, pool_mask = batch["features"]["attention_mask"], batch["features"]["pool_mask"]
    assert pool_mask[:4, : 1 + len(instruction)].sum() == 0
    assert torch.equal(pool_mask[:4, 1 + len(instruction):], mask[:4, 1 + len(instruction):])
    assert torch.equal(pool_mask[4:], mask[4:])
    with pytest.raises(SentEmbUserError, match=r"data.datasets.nli.query_max_len .*leaves no token"):
        method.collate(mixture_examples(method, source._replace(query_max_len=len(instruction) + 2)))


@pytest.mark.parametrize("backbone, padding_free, pooler", [
    ("tiny_bert", True, "avg"), ("tiny_bert", False, "avg"), ("tiny_qwen2", True, "avg"), ("tiny_qwen2", False, "avg"),
    ("tiny_bert", True, "avg_top2")])
def test_pooling_leaves_the_instruction_out_as_an_independent_masked_mean(backbone, padding_free, pooler, request):
    path = request.getfixturevalue(backbone)
    method = no_dropout(build_method(SimCSE, path, pooler=pooler, mlp="none",
                                     attn_implementation=None if padding_free else "padded"))
    assert method.encoder.padding_free == padding_free
    source = source_for(method)
    batch = method.collate(mixture_examples(method, source, negatives=False))
    with torch.no_grad():
        got = method.embed(batch["features"])
    # independent: the backbone's own forward on each unpadded row, averaged by hand from the text on
    reference = AutoModel.from_pretrained(path).eval()
    skip = 1 + len(source.instruction_ids)  # [CLS] (both tiny tokenizers are MiniLM's) and the instruction
    assert method.encoder.format.prefix_ids == [method.tokenizer.cls_token_id]
    rows = batch["features"]["input_ids"]
    for i, row in enumerate(rows):
        real = row[batch["features"]["attention_mask"][i].bool()]
        with torch.no_grad():
            states = reference(real[None], output_hidden_states=True).hidden_states
        hidden = states[-1][0] if pooler == "avg" else (states[-1][0] + states[-2][0]) / 2
        want = hidden[skip:].mean(0) if i < len(QUERIES) else hidden.mean(0)
        torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-5)
    # pooled with the instruction: the whole row's mean
    method.hparams.pool_instruction = True
    method._collator = None
    with torch.no_grad():
        pooled_all = method.embed(method.collate(mixture_examples(method, source, negatives=False))["features"])
    assert "pool_mask" not in method.collate(mixture_examples(method, source, negatives=False))["features"]
    assert not torch.allclose(pooled_all[0], got[0], atol=1e-4)
    torch.testing.assert_close(pooled_all[len(QUERIES):], got[len(QUERIES):])


def own_candidates_by_hand(anchors, positives, negatives, temperature, weight):
    """A loop over the rows: each anchor's softmax over its positive and its own hard negative."""
    losses = []
    for a, p, n in zip(anchors, positives, negatives, strict=True):
        logits = torch.stack([F.cosine_similarity(a, p, dim=0),
                              F.cosine_similarity(a, n, dim=0) + weight * temperature])
        losses.append(-torch.log_softmax(logits / temperature, 0)[0])
    return torch.stack(losses).mean()


def test_without_in_batch_negatives_each_query_scores_its_own_candidates_only():
    torch.manual_seed(0)
    method = SimCSE.__new__(SimCSE)  # the loss alone: no backbone needed
    nn.Module.__init__(method)
    from lightning_sentemb.losses.info_nce import InfoNCELoss
    method.loss_fn = InfoNCELoss(0.05, hard_negative_weight=0.5)
    source = MixtureSource(index=1, name="bge_classification", in_batch_negatives=False)
    embeddings = torch.randn(3 * 5, 8, dtype=torch.float64, requires_grad=True)
    loss, _ = method.embedding_loss(embeddings, {"num_views": 3, "dataset": source})
    views = embeddings.unflatten(0, (3, -1))
    want = own_candidates_by_hand(views[0], views[1], views[2], 0.05, 0.5)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=0)
    (got_grad,) = torch.autograd.grad(loss, embeddings)
    (want_grad,) = torch.autograd.grad(want, embeddings)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-12)
    # in-batch negatives on: other rows' positives count, so the loss differs
    in_batch, _ = method.embedding_loss(embeddings, {"num_views": 3})
    assert abs(float(in_batch.detach()) - float(loss.detach())) > 1e-3
    # the guide's drop over the global columns [positives | hard negatives], read at each row's own two
    drop = torch.zeros(5, 10, dtype=torch.bool)
    drop[2, 5 + 2] = True  # row 2's own hard negative
    drop[0, 5 + 3] = True  # another row's: no effect here
    dropped, _ = method.embedding_loss(embeddings, {"num_views": 3, "dataset": source}, drop)
    kept = [0, 1, 3, 4]
    row2 = -torch.log_softmax(torch.stack([F.cosine_similarity(views[0][2], views[1][2], dim=0) / 0.05]), 0)[0]
    want = (own_candidates_by_hand(views[0][kept], views[1][kept], views[2][kept], 0.05, 0.5) * 4 + row2) / 5
    torch.testing.assert_close(dropped, want, rtol=1e-12, atol=0)
    with pytest.raises(SentEmbUserError, match="bge_classification.in_batch_negatives false: .*no hard negatives"):
        method.embedding_loss(embeddings[:10], {"num_views": 2, "dataset": source})


def test_own_candidate_logits_are_fp32_under_bf16_autocast():
    from lightning_sentemb.losses.info_nce import InfoNCELoss
    anchors, candidates = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(4, 2, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = InfoNCELoss(0.05).own_candidates(anchors, candidates)
    assert loss.dtype == torch.float32


@pytest.mark.parametrize("options, in_batch", [({}, True), ({"matryoshka_dims": [32, 8], "guide": "self"}, False)])
def test_gradient_caching_is_exact_on_an_instructed_batch(options, in_batch, tiny_bert):
    """float64 (tests/test_grad_cache.py): chunks of 3 rows cut across queries with and without their
    pool mask; Matryoshka and the self-guide on the same rows."""
    torch.manual_seed(0)
    method = no_dropout(build_method(SimCSE, tiny_bert, pooler="avg", hard_negative_weight=0.3, **options)).double()
    method.train()
    batch = method.collate(mixture_examples(method, source_for(method, in_batch_negatives=in_batch)))
    loss, want = gradients(method, batch, 0)
    cached_loss, got = gradients(method, batch, 3)
    torch.testing.assert_close(cached_loss, loss, rtol=1e-12, atol=0)
    assert relative_error(got, want) < 1e-10


def test_a_method_that_does_not_apply_a_dataset_setting_refuses_it_in_one_line(tiny_bert):
    method = build_method(PromptBERT, tiny_bert)
    source = source_for(method)
    with pytest.raises(SentEmbUserError, match=r"^data.datasets.nli.instruction: PromptBERT does not apply it"):
        method.check_source(source)
    method.check_source(MixtureSource(index=0, name="plain"))  # a dataset asking nothing: any method
    echo = build_method(SimCSE, tiny_bert, template="echo")
    with pytest.raises(SentEmbUserError, match="template wraps the sentence"):
        echo.check_source(source)


def test_an_export_encodes_with_its_prompts_as_we_do(tiny_bert, tmp_path):
    """sentence-transformers puts the prompt before the text and leaves its tokens (with [CLS]) out of the
    mean (`include_prompt: false`): our `encode(prompt=...)`, the instruction tokenized apart as in training."""
    from sentence_transformers import SentenceTransformer

    from lightning_sentemb.export import export
    from lightning_sentemb.loading import load_embedder

    prefix = instruction_prefix("Retrieve a sentence that means the same")
    method = no_dropout(build_method(SimCSE, tiny_bert, pooler="avg", mlp="none", prompts={"nli": prefix}))
    folder = export(method, tmp_path / "export")
    model = SentenceTransformer(str(folder), device="cpu")
    assert model.prompts["nli"] == prefix and model.default_prompt_name is None
    ours = method.encode(QUERIES, prompt=prefix)
    theirs = model.encode(QUERIES, prompt_name="nli", convert_to_tensor=True)
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model.encode(DOCS, convert_to_tensor=True), method.encode(DOCS), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(ours, method.encode(QUERIES), atol=1e-4)  # the prompt matters
    # the folder read back by `sentemb evaluate` offers the same prompts to MTEB
    assert load_embedder(str(folder), pooler="avg").prompts == {"nli": prefix}


def test_fit_gives_the_method_the_prompts_of_its_datasets(tiny_bert, tmp_path, monkeypatch):
    """`data.datasets`' instructions, in `data.instruction_format`, become the method's `prompts` (what its
    export carries): the demo's three (E5's format), and the llm2vec config's 14 (LLM2Vec's format)."""
    from lightning.pytorch import Trainer

    from lightning_sentemb.lightning_cli import lightning_main

    from .conftest import REPO, write_sts_fixture

    monkeypatch.setattr(Trainer, "fit", lambda *args, **kwargs: None)  # the configured objects, not a run
    echo_data = write_sts_fixture(tmp_path / "data") / "corpora" / "echo-data"  # the E5 data (empty: not read)
    echo_data.mkdir(parents=True)
    for name in yaml.safe_load((REPO / "experiments/llm/llm2vec_supervised.yaml").read_text())["data"]["datasets"]:
        (echo_data / f"{name}.jsonl").touch()
    prompts = {}
    llm2vec_data = ["--data.data_dir", str(tmp_path / "data")]
    for config, data in (("demo/mixture.yaml", []), ("llm/llm2vec_supervised.yaml", llm2vec_data)):
        cli = lightning_main(["fit", "-c", str(REPO / "experiments" / config), "--model.init_args.backbone", tiny_bert,
                              "--model.init_args.lora", "null", "--model.init_args.bidirectional", "false",
                              "--trainer.default_root_dir", str(tmp_path / config), *data])
        prompts[config] = cli.model.hparams.prompts
    assert prompts["demo/mixture.yaml"] == {
        "snli": "Instruct: Given a premise, retrieve a hypothesis that is entailed by the premise\nQuery: ",
        "stsb": "Instruct: Retrieve semantically similar text\nQuery: ",
        "wiki": "Instruct: Retrieve semantically similar text\nQuery: "}
    llm2vec = prompts["llm/llm2vec_supervised.yaml"]
    assert len(llm2vec) == 14
    assert llm2vec["fever"] == "Given a claim, retrieve documents that support or refute the claim; "
