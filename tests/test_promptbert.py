"""PromptBERT and the template format: construction, truncation, denoising, stages, export, demo fit."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig

from lightning_sentemb.backbones import family_of
from lightning_sentemb.encoders.template import TemplateEncoder, TemplateFormat
from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.export import export
from lightning_sentemb.methods import DCPCSE
from lightning_sentemb.methods.building import build_method
from lightning_sentemb.methods.promptbert import BERT_TEMPLATES, ROBERTA_TEMPLATES, PromptBERT, default_templates

# Sentences that start with "a" and end without punctuation: with byte-level BPE, text glued to a
# quote can merge across the boundary ("'t…", " .'"), which the per-piece tokenization cannot see.
SENTENCES = ["a man is playing a guitar", "an old cat sat on the mat", "a woman is slicing an onion"]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bert_method(tiny_bert: str) -> PromptBERT:
    torch.manual_seed(0)
    return build_method(PromptBERT, tiny_bert)


@pytest.fixture(scope="module")
def roberta_method(tiny_roberta: str) -> PromptBERT:
    torch.manual_seed(0)
    return build_method(PromptBERT, tiny_roberta)


@pytest.mark.parametrize("fixture, templates", [("tiny_bert", BERT_TEMPLATES), ("tiny_roberta", ROBERTA_TEMPLATES)])
def test_default_templates_follow_the_backbone_family(fixture: str, templates: tuple[str, ...], request) -> None:
    config = AutoConfig.from_pretrained(request.getfixturevalue(fixture))
    assert default_templates(family_of(config)) == templates


@pytest.mark.parametrize("name", ["bert_method", "roberta_method"])
def test_template_rows_match_tokenizing_the_full_text(name: str, request) -> None:
    """prefix + cached sentence ids + suffix == the tokenizer on the filled-in template (special tokens
    included), for WordPiece and byte-level BPE."""
    method = request.getfixturevalue(name)
    fmt = method.encoder.format
    for index, template in enumerate(fmt.templates):
        for sentence in SENTENCES:
            row = fmt.wrap(fmt.sentence_ids([sentence])[0], None, index)
            text = template.text.replace("[X]", sentence).replace("[MASK]", method.tokenizer.mask_token)
            assert row == method.tokenizer(text)["input_ids"]


def test_roberta_rows_are_the_reference_token_ids() -> None:
    """The reference (kongds/Prompt-BERT train.py) cuts its template at the sentence, tokenizes
    `This sentence : '` (dropping </s>) and ` ' means<mask>.` (dropping <s>) each alone, and puts the
    sentence's ids without special tokens between. A byte-level BPE whose vocabulary holds both
    `Ġ'`/`'` and `Ġ.`/`.` tells the two tokenizations apart."""
    from tokenizers import AddedToken, ByteLevelBPETokenizer, processors
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    corpus = ["This sentence : ' a man plays ' means it .", "The sentence : 'x' means.", "a dog runs ."] * 10
    bpe.train_from_iterator(corpus, vocab_size=300, min_frequency=1,
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    bpe.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>",
                                        cls_token="<s>", sep_token="</s>", pad_token="<pad>", unk_token="<unk>",
                                        mask_token=AddedToken("<mask>", lstrip=True))
    assert {"Ġ'", "'", "Ġ.", "."} <= set(tokenizer.get_vocab())
    fmt = TemplateFormat(tokenizer, ROBERTA_TEMPLATES, first_position=2)
    sentence = tokenizer("a man plays", add_special_tokens=False)["input_ids"]
    for index, start in enumerate(["This sentence : '", "The sentence : '"]):
        reference = tokenizer.encode(start)[:-1] + sentence + tokenizer.encode(" ' means<mask>.")[1:]
        assert fmt.wrap(sentence, None, index) == reference
        assert tokenizer.convert_ids_to_tokens(reference[-5:]) == ["Ġ'", "Ġmeans", "<mask>", ".", "</s>"]


@pytest.mark.parametrize("name", ["bert_method", "roberta_method"])
def test_only_the_sentence_is_truncated(name: str, request) -> None:
    method = request.getfixturevalue(name)
    fmt = method.encoder.format
    long = fmt.sentence_ids([" ".join(SENTENCES * 5)])[0]
    template = fmt.templates[1]
    for max_length in (len(template) + 3, len(template) + 10):
        row = fmt.build([long], max_length, templates=[1])["input_ids"][0].tolist()
        assert len(row) == max_length
        assert row[: len(template.prefix)] == template.prefix
        assert row[len(row) - len(template.suffix) :] == template.suffix
        assert row[len(template.prefix) : len(row) - len(template.suffix)] == long[: max_length - len(template)]
    # the DataModule's max_seq_len is the sentence's own budget: the template comes on top
    assert fmt.num_special_tokens == 0


@pytest.mark.parametrize("name", ["bert_method", "roberta_method"])
def test_every_row_has_exactly_one_mask(name: str, request) -> None:
    method = request.getfixturevalue(name)
    fmt = method.encoder.format
    mask = method.tokenizer.mask_token
    sentences = SENTENCES + ["", f"a {mask} in the sentence .", " ".join(SENTENCES * 10)]
    ids = fmt.sentence_ids(sentences)
    features = fmt.build(ids, 40, templates=[i % 2 for i in range(len(ids))], denoise=True)
    assert features["input_ids"].size(0) == len(ids) + features["bias_index"].max() + 1
    assert ((features["input_ids"] == fmt.mask_id).sum(1) == 1).all()


@pytest.mark.parametrize("name", ["bert_method", "roberta_method"])
def test_explicit_positions_are_the_backbones_own(name: str, request) -> None:
    """The format's position ids reproduce the backbone's default ones (RoBERTa counts from padding_idx+1)."""
    method = request.getfixturevalue(name)
    encoder = method.encoder.eval()
    features = encoder.format.build(encoder.format.sentence_ids(SENTENCES), None)
    assert features["position_ids"][0, 0] == encoder.family.first_position()
    with torch.no_grad():
        explicit = encoder.run_backbone(features)  # padding-free, with the format's positions
        encoder.set_padding_free(False)  # the backbone's own forward, called directly, numbers positions itself
        default = encoder.backbone(input_ids=features["input_ids"], attention_mask=features["attention_mask"])
        encoder.set_padding_free(True)
    mask = features["attention_mask"].bool()
    torch.testing.assert_close(explicit.last_hidden_state[mask], default.last_hidden_state[mask])
    method.train()


@pytest.mark.parametrize("name", ["bert_method", "roberta_method"])
def test_bias_rows_keep_the_full_rows_positions(name: str, request) -> None:
    """A bias row is the full row without the sentence, each template token at the position it has
    in the full row."""
    method = request.getfixturevalue(name)
    fmt = method.encoder.format
    ids = fmt.sentence_ids(SENTENCES)
    templates = [0, 1, 1]
    features = fmt.build(ids, None, templates=templates, denoise=True)
    n = len(ids)
    for i, (sentence, which) in enumerate(zip(ids, templates, strict=True)):
        start = len(fmt.templates[which].prefix)
        keep = [p for p in range(int(features["attention_mask"][i].sum())) if not start <= p < start + len(sentence)]
        bias = n + int(features["bias_index"][i])
        width = len(keep)
        assert features["attention_mask"][bias].sum() == width
        assert features["input_ids"][bias, :width].tolist() == features["input_ids"][i, keep].tolist()
        assert features["position_ids"][bias, :width].tolist() == features["position_ids"][i, keep].tolist()


def test_one_bias_row_per_template_and_length(bert_method: PromptBERT) -> None:
    fmt = bert_method.encoder.format
    ids = [[1037, 2158], [2158, 1037], [1037], [1037, 2158]]
    features = fmt.build(ids, None, templates=[0, 0, 0, 1], denoise=True)
    assert features["bias_index"].tolist() == [0, 0, 1, 2]
    assert features["input_ids"].size(0) == 4 + 3


@pytest.mark.parametrize("name", ["bert_method", "roberta_method"])
def test_denoising_subtracts_the_empty_template_state(name: str, request) -> None:
    method = request.getfixturevalue(name)
    encoder = method.encoder.eval()
    fmt = encoder.format
    ids = fmt.sentence_ids(SENTENCES + [""])
    with torch.no_grad():
        plain = encoder(fmt.build(ids, None))
        denoised = encoder(fmt.build(ids, None, denoise=True))
        # the bias of sentence 0 by hand: the empty template at the shifted positions, alone
        t = fmt.templates[0]
        shift = len(ids[0])
        positions = list(range(len(t.prefix))) + list(range(len(t.prefix) + shift, len(t) + shift))
        first = encoder.family.first_position()
        row = {
            "input_ids": torch.tensor([t.prefix + t.suffix]),
            "attention_mask": torch.ones(1, len(t), dtype=torch.long),
            "position_ids": torch.tensor([positions]) + first,
            "pool_position": torch.tensor([t.readout_position(0)]),
        }
        bias = encoder(row)
    method.train()
    torch.testing.assert_close(denoised[0], plain[0] - bias[0], atol=1e-5, rtol=1e-5)
    # an empty sentence is its own bias row
    assert denoised[-1].abs().max() < 1e-5


def test_denoising_switch_follows_the_stage(tiny_bert: str) -> None:
    method = build_method(PromptBERT, tiny_bert, denoise_train=False, denoise_val=True, denoise_test=False)
    batch = method.collate([{"sent0": ids} for ids in method.encoder.format.sentence_ids(SENTENCES)])
    assert "bias_index" not in batch["features"]
    assert "bias_index" not in method.sentence_features(SENTENCES)  # no trainer: the test switch
    method._trainer = SimpleNamespace(validating=True, sanity_checking=False)
    assert "bias_index" in method.sentence_features(SENTENCES)
    method._trainer = SimpleNamespace(validating=False, sanity_checking=False)  # testing
    assert "bias_index" not in method.sentence_features(SENTENCES)
    method._trainer = None


def test_unsupervised_views_use_two_templates(bert_method: PromptBERT) -> None:
    ids = bert_method.encoder.format.sentence_ids(SENTENCES)
    batch = bert_method.collate([{"sent0": i} for i in ids])
    assert batch["num_views"] == 2 and batch["batch_size"] == 3
    rows = batch["features"]["input_ids"]
    first, second = bert_method.encoder.format.templates
    assert rows[0, : len(first.prefix)].tolist() == first.prefix
    assert rows[3, : len(second.prefix)].tolist() == second.prefix
    loss, _ = bert_method.training_loss(batch)
    loss.backward()
    assert torch.isfinite(loss)
    assert bert_method.mlp[0].weight.grad is not None
    bert_method.zero_grad()


def test_supervised_triplets_use_the_first_template(bert_method: PromptBERT) -> None:
    ids = bert_method.encoder.format.sentence_ids(SENTENCES)
    batch = bert_method.collate(
        [{"sent0": ids[i], "sent1": ids[(i + 1) % 3], "hard_neg": ids[(i + 2) % 3]} for i in range(3)]
    )
    assert batch["num_views"] == 3 and batch["batch_size"] == 3
    prefix = bert_method.encoder.format.templates[0].prefix
    assert all(row[: len(prefix)] == prefix for row in batch["features"]["input_ids"][:9].tolist())
    assert torch.isfinite(bert_method.training_loss(batch)[0])


def test_pooler_and_mlm_are_fixed(tiny_bert: str) -> None:
    with pytest.raises(SentEmbUserError, match="mask"):
        build_method(PromptBERT, tiny_bert, pooler="cls")
    with pytest.raises(SentEmbUserError, match="MLM"):
        build_method(PromptBERT, tiny_bert, mlm_weight=0.1)
    with pytest.raises(SentEmbUserError, match="exactly once"):
        TemplateEncoder(tiny_bert, ["no sentence here [MASK] ."])
    with pytest.raises(SentEmbUserError, match="mask token exactly once"):
        TemplateFormat(build_method(PromptBERT, tiny_bert).tokenizer, ["[X] means nothing ."])


def sentence_transformer(folder: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu", trust_remote_code=True)


@pytest.mark.parametrize("fixture", ["tiny_bert", "tiny_roberta"])
@pytest.mark.parametrize("denoise_test, mlp", [(False, "train"), (True, "always")])
def test_export_reproduces_encode(fixture: str, denoise_test: bool, mlp: str, tmp_path: Path, request) -> None:
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    torch.manual_seed(0)
    method = build_method(PromptBERT, request.getfixturevalue(fixture), denoise_test=denoise_test, mlp=mlp)
    sentences = SENTENCES + ["a much longer sentence about a man who plays the guitar on the street ."]
    expected = method.encode(sentences)
    folder = export(method, tmp_path / "export")
    AutoModel.from_pretrained(folder)
    with pytest.raises(ValueError, match="trust_remote_code"):
        SentenceTransformer(str(folder), device="cpu")
    model = sentence_transformer(folder)
    torch.testing.assert_close(model.encode(sentences, convert_to_tensor=True), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method_class, options", [(PromptBERT, {"mlp": "always"}),
                                                    (DCPCSE, {"prefix_len": 4, "pooler": "avg", "mlp": "always"})])
def test_export_encodes_in_its_methods_eval_precision(method_class, options: dict, tiny_bert: str,
                                                       tmp_path: Path) -> None:
    """A template or prefix export saves the method's `eval_precision`: sentence-transformers runs its
    backbone under that autocast, and `load_embedder` (`sentemb evaluate`, MTEB) encodes it exactly as the
    checkpoint's `encode` does, in the precision asked for. On CPU: bf16 ("auto" is fp32 there)."""
    from lightning_sentemb.loading import load_embedder

    torch.manual_seed(0)
    method = build_method(method_class, tiny_bert, eval_precision="bf16", **options)
    bf16 = method.encode(SENTENCES)
    method.hparams.eval_precision = "32"
    fp32 = method.encode(SENTENCES)
    method.hparams.eval_precision = "bf16"
    assert not torch.allclose(bf16, fp32, rtol=0, atol=1e-3)
    folder = export(method, tmp_path / "export")
    for precision, expected in (("bf16", bf16), ("32", fp32)):
        got = load_embedder(str(folder), eval_precision=precision).encode(SENTENCES)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6, msg=precision)
    model = sentence_transformer(folder)
    module = model[0]
    assert module.eval_precision == "bf16"
    backbone = module.prefixed.backbone if method_class is DCPCSE else module.encoder.backbone
    autocast = []
    backbone.register_forward_pre_hook(lambda *_: autocast.append(torch.is_autocast_enabled("cpu")
                                                                  and torch.get_autocast_dtype("cpu")))
    model.encode(SENTENCES)
    assert set(autocast) == {torch.bfloat16}


def cli_args(command: str, config: str, root: Path, data: Path, options: str) -> list[str]:
    """`sentemb COMMAND -c experiments/demo/CONFIG` in `root` on `data`, plus whitespace-separated options."""
    demo = str(REPO / "experiments" / "demo" / config)
    return [command, "-c", demo, "--trainer.default_root_dir", str(root), "--data.data_dir", str(data),
            *options.split()]


def check_demo_fit(config: str, tmp_path: Path, data: Path) -> None:
    """A short fit and test of a demo config; its checkpoint reloads with its own pooling and
    exports to a sentence-transformers folder that reproduces it. In fp32 (the demo tests all are): on a CPU
    without bf16 instructions (AVX2) a bf16 step runs several times slower, and bf16 autocast has its own tests."""
    from lightning_sentemb.cli import main
    from lightning_sentemb.loading import load_method

    root = tmp_path / "run"
    # 2 steps of 8, 1 scored batch of 32: every path of the demo (fit, checkpoint, test, reload, export), not its scores
    fit = "--trainer.max_steps 2 --trainer.val_check_interval 2 --trainer.limit_val_batches 1"
    main(cli_args("fit", config, root, data, f"{fit} --data.max_train_examples 16 --data.batch_size 8 "
                  f"--data.eval_batch_size 32 --trainer.precision 32-true --data.cache_dir {root / 'cache'}"))
    checkpoint = root / "checkpoints" / "best.ckpt"
    assert checkpoint.exists()
    test = (f"--ckpt_path {checkpoint} --data.test_tasks [STSBenchmark] --trainer.limit_test_batches 1 "
            "--data.eval_batch_size 32 --trainer.precision 32-true")
    main(cli_args("test", config, root, data, test))
    method = load_method(str(checkpoint))
    expected = method.encode(SENTENCES)
    main(["export", str(checkpoint), str(tmp_path / "export")])
    model = sentence_transformer(tmp_path / "export")
    torch.testing.assert_close(model.encode(SENTENCES, convert_to_tensor=True), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_demo_fit(tmp_path: Path, shared_data: Path) -> None:
    check_demo_fit("promptbert.yaml", tmp_path, shared_data)
