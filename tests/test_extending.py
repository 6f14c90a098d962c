"""A method of your own, outside the package: the docs' example (examples/my_method.py) copied into a
folder of the user's, trained, evaluated and exported by `sentemb` with no PYTHONPATH pointing at it,
and its export loaded by sentence-transformers where the user's module cannot be imported."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_sentemb.cli import main
from lightning_sentemb.export.model_card import PAPERS
from lightning_sentemb.methods.building import build_method

REPO = Path(__file__).resolve().parents[1]
SENTENCES = ["a man plays guitar", "the cat sleeps on the mat", "kids play football today"]


def sentemb(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`sentemb ARGS` run from `cwd` as the installed command runs: `-P` keeps Python from putting the
    working directory on sys.path itself, and PYTHONPATH holds only this checkout (the installed package)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, "-P", "-m", "lightning_sentemb.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # four fresh processes (the user's commands); the in-process checks below are the fast path
def test_the_docs_example_method_trains_evaluates_and_exports_from_the_users_folder(
    tiny_bert, sts_fixture, tmp_path, monkeypatch
):
    assert "examples/my_method.py" in (REPO / "docs" / "extending.md").read_text()  # the file the docs walk through
    user = tmp_path / "project"
    user.mkdir()
    for name in ("my_method.py", "my_method.yaml"):
        shutil.copy(REPO / "examples" / name, user / name)
    run = tmp_path / "run"
    # fit from the folder above: the module is found beside its config
    fit = sentemb(tmp_path, "fit", "-c", "project/my_method.yaml", "--model.init_args.backbone", tiny_bert,
                  "--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--trainer.precision", "32",
                  "--trainer.default_root_dir", str(run), "--trainer.accelerator", "cpu", "--data.batch_size", "8",
                  "--data.data_dir", str(sts_fixture), "--data.cache_dir", str(tmp_path / "cache"),
                  "--data.val_tasks", "[STSBenchmark-dev]", "--trainer.enable_model_summary", "false")
    assert fit.returncode == 0, fit.stderr[-3000:]
    assert "SymmetricSimCSE" in fit.stdout + fit.stderr
    metrics = (run / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert "train/positive_cosine" in metrics.splitlines()[0]  # the method's extra log
    best = run / "checkpoints" / "best.ckpt"
    assert torch.load(best, weights_only=False)["sentemb_method"] == "my_method.SymmetricSimCSE"

    # evaluate and export from the user's folder: the module is found in the working directory
    evaluated = sentemb(user, "evaluate", "--model", str(best), "--data-dir", str(sts_fixture), "--output",
                        str(tmp_path / "scores.json"))
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "STSBenchmark" in json.loads((tmp_path / "scores.json").read_text())["sts"]
    exported = sentemb(user, "export", str(best), str(tmp_path / "export"))
    assert exported.returncode == 0, exported.stderr[-3000:]

    card = (tmp_path / "export" / "README.md").read_text()
    assert "# SymmetricSimCSE on " in card and "`my_method.SymmetricSimCSE`" in card
    assert PAPERS["SimCSE"].url not in card and "@inproceedings" not in card  # a subclass is not the paper

    # sentence-transformers in a fresh process where `my_method` cannot be imported
    load = ("import importlib.util, json, sys; from sentence_transformers import SentenceTransformer; "
            "assert importlib.util.find_spec('my_method') is None; "
            f"model = SentenceTransformer({str(tmp_path / 'export')!r}, device='cpu'); "
            f"print(json.dumps(model.encode({SENTENCES!r}).tolist()))")
    loaded = subprocess.run([sys.executable, "-P", "-c", load], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONPATH": ""})
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    monkeypatch.syspath_prepend(str(user))
    from lightning_sentemb.loading import load_method

    expected = load_method(str(best)).encode(SENTENCES)
    torch.testing.assert_close(torch.tensor(json.loads(loaded.stdout.strip().splitlines()[-1])), expected,
                               atol=1e-5, rtol=1e-4)


def test_a_missing_method_module_is_one_line_naming_where_it_was_looked_for(tmp_path, capsys, monkeypatch):
    config = tmp_path / "configs" / "mine.yaml"
    config.parent.mkdir()
    config.write_text("model:\n  class_path: not_written_yet.MyMethod\n  init_args:\n    backbone: x\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "-c", str(config)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert "no module named 'not_written_yet'" in err and "not_written_yet.py" in err
    assert str(tmp_path) in err and str(config.parent) in err


def test_a_custom_method_that_changes_its_embedding_is_not_exported_as_its_base(tiny_bert, tmp_path, capsys):
    from lightning_sentemb.errors import SentEmbUserError
    from lightning_sentemb.export import export
    from lightning_sentemb.methods import SimCSE

    class LastLayerTwice(SimCSE):
        __module__ = "my_methods"  # as if defined in the user's file

        def embed(self, features):
            return 2 * super().embed(features)

    with pytest.raises(SentEmbUserError, match="overrides embed .* override write_export"):
        export(build_method(LastLayerTwice, tiny_bert), tmp_path / "out")
    assert not (tmp_path / "out").exists()
