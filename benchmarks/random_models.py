"""Randomly initialized backbones for the benchmarks: speed and memory do not depend on the weights,
and no LLM checkpoint is installable offline."""

from __future__ import annotations

import os

import torch

QWEN2_100M = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 2,
              "intermediate_size": 2048}
BPE_VOCAB = 30_000


def wiki_bpe_tokenizer():
    """A byte-level BPE tokenizer trained on the wiki1m mirror (GPT-2 / Qwen2 style, `<|endoftext|>` its
    EOS and pad), so sentences get a real LLM's token lengths. (A WordPiece vocabulary in a Qwen2 folder
    does not work: transformers loads a Qwen2 folder's tokenizer as Qwen2's byte-level BPE, which without
    merges splits every character.)"""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from lightning_sentemb.data.paths import resolve_data_dir

    corpus = resolve_data_dir() / "corpora" / "wiki1m_for_simcse.txt"
    lines = [line.strip() for line in corpus.read_text(encoding="utf8").splitlines() if line.strip()]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(lines, vocab_size=BPE_VOCAB, min_frequency=2, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", model_max_length=512)


def qwen2_decoder(folder: str, **sizes: int) -> str:
    """A Qwen2-shaped decoder, by default of about 100M parameters (`QWEN2_100M`: grouped-query attention
    12 heads over 2 key/value heads, gated MLP 2048 wide, qkv biases; `sizes` override it) with a BPE
    tokenizer trained on the wiki1m mirror (`wiki_bpe_tokenizer`), written to `folder` once; returns
    `folder`."""
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    from transformers import Qwen2Config, Qwen2Model

    tokenizer = wiki_bpe_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                         **{**QWEN2_100M, **sizes})
    torch.manual_seed(0)
    Qwen2Model(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


OPT_125M = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "ffn_dim": 3072,
            "word_embed_proj_dim": 768}


def opt_decoder(folder: str, **sizes: int) -> str:
    """An OPT-shaped decoder (PromptEOL's backbone family), by default OPT-125M's shape (`OPT_125M`),
    with the wiki1m BPE tokenizer, written to `folder` once; returns `folder`."""
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    from transformers import OPTConfig, OPTModel

    tokenizer = wiki_bpe_tokenizer()
    config = OPTConfig(vocab_size=len(tokenizer), max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                       **{**OPT_125M, **sizes})
    torch.manual_seed(0)
    OPTModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
