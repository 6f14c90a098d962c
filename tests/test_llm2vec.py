"""The LLM2Vec pipeline through the `sentemb` CLI on a tiny random decoder, offline: the MNTP config, its
merged export, then the SimCSE config on that export, which starts from the MNTP weights (not the base's)
with bidirectional attention and mean pooling."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from lightning_sentemb.cli import main
from lightning_sentemb.loading import load_method

from .conftest import REPO

CONFIGS = REPO / "experiments" / "llm"


def short_run(config: str, backbone: str, data: Path, root: Path) -> list[str]:
    return ["fit", "-c", str(CONFIGS / config), "--model.init_args.backbone", backbone,
            "--data.data_dir", str(data), "--data.cache_dir", str(root / "cache"), "--data.batch_size", "8",
            "--trainer.default_root_dir", str(root), "--trainer.max_steps", "1", "--trainer.precision", "32",
            "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
            "--trainer.limit_val_batches", "1", "--model.init_args.lr", "1e-2"]


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return {name: tensor for file in sorted(folder.glob("*.safetensors")) for name, tensor in load_file(file).items()}


def test_llm2vec_mntp_then_simcse_from_its_export(tiny_qwen2: str, sts_fixture: Path, tmp_path: Path) -> None:
    mntp_root, simcse_root = tmp_path / "mntp", tmp_path / "simcse"
    main(short_run("llm2vec_mntp.yaml", tiny_qwen2, sts_fixture, mntp_root))
    export = tmp_path / "mntp_export"
    main(["export", str(mntp_root / "checkpoints" / "last.ckpt"), str(export)])
    base, adapted = weights(Path(tiny_qwen2)), weights(export)
    changed = [name for name in adapted if not torch.equal(adapted[name], base[name])]
    assert changed and all("proj" in name for name in changed)  # LoRA merged into the projections only

    main(short_run("llm2vec_simcse.yaml", str(export), sts_fixture, simcse_root))
    simcse = load_method(str(simcse_root / "checkpoints" / "last.ckpt"))
    assert simcse.hparams.backbone == str(export) and simcse.hparams.pooler == "avg"
    assert simcse.encoder.bidirectional and not simcse.encoder.backbone.config.is_causal
    frozen = {name.replace("base_layer.", ""): p for name, p in simcse.encoder.backbone.named_parameters()
              if not p.requires_grad}
    for name in changed:  # the SimCSE run's frozen base is the MNTP export, not the random base
        torch.testing.assert_close(frozen[name], adapted[name], rtol=0, atol=0)
