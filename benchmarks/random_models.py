"""Randomly initialized backbones for the benchmarks: speed and memory do not depend on the weights,
and no LLM checkpoint is installable offline."""

from __future__ import annotations

import os
from typing import Any

import torch

QWEN2_100M = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 2,
              "intermediate_size": 2048}
BPE_VOCAB = 30_000


def bpe_tokenizer(lines: list[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on `lines` (GPT-2 / Qwen2 style, `<|endoftext|>` its EOS and
    pad). (A WordPiece vocabulary in a Qwen2 folder does not work: transformers loads a Qwen2 folder's
    tokenizer as Qwen2's byte-level BPE, which without merges splits every character.)"""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(lines, vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", model_max_length=512)


def wiki_bpe_tokenizer(max_lines: int | None = None):
    """`bpe_tokenizer` trained on the wiki1m mirror (its first `max_lines` lines: a quick check needs no
    more), so sentences get a real LLM's token lengths."""
    from lightning_sentemb.data.paths import resolve_data_dir

    corpus = resolve_data_dir() / "corpora" / "wiki1m_for_simcse.txt"
    lines = [line.strip() for line in corpus.read_text(encoding="utf8").splitlines()[:max_lines] if line.strip()]
    return bpe_tokenizer(lines, BPE_VOCAB)


def qwen2_decoder(folder: str, tokenizer_lines: int | None = None, **sizes: int) -> str:
    """A Qwen2-shaped decoder, by default of about 100M parameters (`QWEN2_100M`: grouped-query attention
    12 heads over 2 key/value heads, gated MLP 2048 wide, qkv biases; `sizes` override it) with a BPE
    tokenizer trained on the wiki1m mirror (`wiki_bpe_tokenizer`, on `tokenizer_lines` lines), written to
    `folder` once; returns `folder`."""
    from transformers import Qwen2Config, Qwen2Model

    return wiki_bpe_decoder(folder, Qwen2Config, Qwen2Model, {**QWEN2_100M, **sizes}, tokenizer_lines)


def wiki_bpe_decoder(folder: str, config_class: Any, model_class: Any, sizes: dict[str, int],
                     tokenizer_lines: int | None = None) -> str:
    """`model_class` of `sizes` with random weights and `wiki_bpe_tokenizer`, written to `folder` once;
    returns `folder`."""
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    tokenizer = wiki_bpe_tokenizer(tokenizer_lines)
    config = config_class(vocab_size=len(tokenizer), max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
                          bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, **sizes)
    torch.manual_seed(0)
    model_class(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# ----- data-free builders (`make gpu-check`: a machine with no hub, no data and no model package) -----
BERT_BASE: dict[str, int] = {}  # BertConfig's defaults are bert-base's
QWEN2_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "vocab_size": 151_936}  # Qwen/Qwen2-0.5B's config.json
TINY_BERT = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
TINY_DECODER = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2}
BERT_VOCAB = 30_522
WORDS = (
    "the of and to in a is was for on as with by he that at from his it an were are which this be or has "
    "had first one their its new after who they two her she been other when there all during into school "
    "time may years more most only over city some world would where later up such used many can state about "
    "national out known university united then made also season team under film three game year american "
    "between called following these while group well both since born war north south river album book music "
    "family people being series show century began through played church county government part de life house "
    "so several however second four because until area her him home best before place name same station town "
    "man woman dog cat runs plays guitar sits mat field weather nice today slicing onion cooks football children "
    "means sentence word summary article topic review positive negative given assume belongs different totally "
    "inconsistent denote definitely not does without news"
).split()


def synthetic_wordpiece(folder: str):
    """An uncased WordPiece tokenizer of bert-base's vocabulary size (30,522) written to `folder`: BERT's
    special tokens, punctuation, single letters and digits (with their `##` continuations, so any text
    tokenizes), `WORDS`, then unused slots. Stands in for bert-base-uncased's vocabulary, which is not
    installable without a hub: the embedding matrix keeps its shape, and `synthetic_sentences` are one
    token a word."""
    import string

    from transformers import BertTokenizerFast

    pieces = list(string.ascii_lowercase + string.digits)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *string.punctuation, *pieces, *(f"##{p}" for p in pieces)]
    vocab += [word for word in dict.fromkeys(WORDS) if word not in vocab]
    vocab += [f"[unused{i}]" for i in range(BERT_VOCAB - len(vocab))]
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "vocab.txt")
    with open(path, "w", encoding="utf8") as f:
        f.write("\n".join(vocab) + "\n")
    return BertTokenizerFast(vocab=path, do_lower_case=True, model_max_length=512)  # transformers 5: not vocab_file


# wiki1m_for_simcse.txt's lines in uncased WordPiece tokens, [CLS] and [SEP] included: the 0th, 5th, ..., 95th
# and the 99th percentile over the 11,914 lines of the offline mirror (all-MiniLM-L6-v2's tokenizer)
WIKI1M_TOKEN_PERCENTILES = (3, 6, 8, 11, 13, 15, 16, 18, 20, 21, 23, 24, 26, 28, 30, 33, 35, 39, 44, 53, 75)


def synthetic_sentences(count: int, seed: int = 0) -> list[str]:
    """`count` sentences of `WORDS` (one token each) and a full stop, as many tokens long as wiki1m's lines:
    each draws one of the 5-percentile bands of `WIKI1M_TOKEN_PERCENTILES` (the top one up to the 99th),
    then a length uniformly within it. Cut to 32 tokens, a batch of 64 is then about as padded as
    wiki1m's: 1.47 tokens in the padded batch per real one (a test checks this against the mirror; the
    uniform 6 to 40 words used before gave 1.33)."""
    generator = torch.Generator().manual_seed(seed)
    percentiles = torch.tensor(WIKI1M_TOKEN_PERCENTILES)
    bands = torch.randint(len(WIKI1M_TOKEN_PERCENTILES) - 1, (count,), generator=generator)
    low, high = percentiles[bands], percentiles[bands + 1]
    tokens = low + (torch.rand(count, generator=generator) * (high - low + 1)).long()
    lengths = (tokens - 3).clamp(min=1).tolist()  # [CLS], the full stop and [SEP] are the other three
    picks = torch.randint(len(WORDS), (sum(lengths),), generator=generator).tolist()
    sentences, start = [], 0
    for length in lengths:
        sentences.append(" ".join(WORDS[i] for i in picks[start : start + length]) + " .")
        start += length
    return sentences


def random_bert(folder: str, **sizes: int) -> str:
    """A BERT (bert-base by default; `sizes` override `BertConfig`) with random weights and an MLM head,
    and `synthetic_wordpiece`, written to `folder`; returns `folder`."""
    from transformers import BertConfig, BertForMaskedLM

    tokenizer = synthetic_wordpiece(folder)
    torch.manual_seed(0)
    BertForMaskedLM(BertConfig(vocab_size=len(tokenizer), **sizes)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def random_qwen2(folder: str, **sizes: int) -> str:
    """A Qwen2 decoder with random weights (Qwen2-0.5B's shapes by default, `QWEN2_05B`, its embedding
    matrix included; `sizes` override them) and a byte-level BPE trained on `synthetic_sentences`
    (`bpe_tokenizer`: a word is one token, as in a real LLM's vocabulary; the ids past it are never
    read), built on the GPU when there is one, written to `folder`; returns `folder`."""
    from transformers import Qwen2Config, Qwen2Model

    tokenizer = bpe_tokenizer(synthetic_sentences(20_000) + [" ".join(WORDS).title()], vocab_size=2_000)
    eos = tokenizer.eos_token_id
    config = Qwen2Config(**{"vocab_size": len(tokenizer), "max_position_embeddings": 4096, "pad_token_id": eos,
                            "bos_token_id": eos, "eos_token_id": eos, **QWEN2_05B, **sizes})
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2Model(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


OPT_125M = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "ffn_dim": 3072,
            "word_embed_proj_dim": 768}


def opt_decoder(folder: str, **sizes: int) -> str:
    """An OPT-shaped decoder (PromptEOL's backbone family), by default OPT-125M's shape (`OPT_125M`),
    with the wiki1m BPE tokenizer, written to `folder` once; returns `folder`."""
    from transformers import OPTConfig, OPTModel

    return wiki_bpe_decoder(folder, OPTConfig, OPTModel, {**OPT_125M, **sizes})
