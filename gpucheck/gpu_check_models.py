"""gpu-check's first parts after the kernels: the models the others read (`models`: a bert-base and a
Qwen2-0.5B-shaped decoder with random weights, tiny ones in --smoke) with their shapes and the N of the MFU,
and the tests marked `cuda` (`cuda_tests`)."""

from __future__ import annotations

import time
from typing import Any

from gpu_check_common import REPO, Context, PartSkipped


def cuda_tests(ctx: Context) -> dict:
    """The tests marked `cuda`, through pytest in this process, read back from its JUnit XML. Only the
    files that mark one are collected: the others may import what this machine lacks."""
    import xml.etree.ElementTree as ElementTree

    import pytest

    files = sorted(str(p) for p in (REPO / "tests").rglob("test_*.py") if "pytest.mark.cuda" in p.read_text("utf8"))
    if not files:
        raise PartSkipped("no test file marks a test with pytest.mark.cuda")
    junit = ctx.results / "cuda_tests.junit.xml"
    code = pytest.main(["-m", "cuda", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", "--rootdir", str(REPO),
                        *files])
    rows = []
    for case in ElementTree.parse(junit).iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = found.get("message", "")
        rows.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                     "seconds": float(case.get("time") or 0),
                     "message": message.splitlines()[0][:200] if message else ""})
    if not rows:
        raise PartSkipped(f"no test is marked cuda (pytest exit code {int(code)})")
    bad = int(code) not in (0, 5) or any(r["outcome"] in ("failed", "error") for r in rows)
    notes = [f"pytest exit code {int(code)}"] if bad else []
    return {"status": "fail" if bad else "pass", "rows": rows, "notes": notes}


def models(ctx: Context) -> dict:
    """bert-base and the Qwen2-0.5B-shaped decoder (tiny ones in --smoke), random weights, into the
    shared folder the other parts read."""
    from random_models import BERT_BASE, QWEN2_05B, TINY_BERT, TINY_DECODER, random_bert, random_qwen2

    shapes = {"bert": (random_bert, TINY_BERT if ctx.smoke else BERT_BASE, ctx.bert),
              "qwen2": (random_qwen2, TINY_DECODER if ctx.smoke else QWEN2_05B, ctx.decoder)}
    rows = []
    for name, (build, sizes, folder) in shapes.items():
        start = time.perf_counter()
        build(folder, **sizes)
        rows.append({"model": name, **model_shape(folder), "build seconds": time.perf_counter() - start})
    return {"status": "pass", "rows": rows}


def model_shape(folder: str) -> dict[str, Any]:
    """Layers, width, heads and parameter counts of a model folder (from a meta-device instance)."""
    import torch
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(folder)
    heads = config.num_attention_heads
    with torch.device("meta"):
        model = AutoModel.from_config(config)
    return {"type": config.model_type, "layers": config.num_hidden_layers, "hidden": config.hidden_size,
            "heads (kv)": f"{heads} ({getattr(config, 'num_key_value_heads', None) or heads})",
            "parameters": sum(p.numel() for p in model.parameters()), "non-embedding": non_embedding_of(folder)}


def non_embedding_of(folder: str) -> int:
    """N of the MFU's 6·N: parameters outside the embedding tables and BERT's pooler, which no
    implementation here computes (cls pooling reads the last hidden state)."""
    import torch
    from gpu import non_embedding_parameters
    from transformers import AutoConfig, AutoModel

    with torch.device("meta"):
        model = AutoModel.from_config(AutoConfig.from_pretrained(folder))
    pooler = getattr(model, "pooler", None)
    return non_embedding_parameters(model) - (sum(p.numel() for p in pooler.parameters()) if pooler is not None else 0)

