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


# The user's three commands, one after the other in one interpreter (a fresh one costs ~9 s of imports), each
# as a fresh `sentemb` process starts: before evaluate and export, `my_method` is forgotten (its module and
# the folders the fit put on sys.path), so they must find it in their own working directory.
USER_COMMANDS = """
import json, os, sys
from lightning_sentemb.cli import main
user, fit, evaluate, export = json.loads(sys.argv[1])
main(fit)
sys.modules.pop("my_method")
sys.path[:] = [folder for folder in sys.path if folder not in (os.getcwd(), user)]
os.chdir(user)
main(evaluate)
main(export)
"""


def sentemb(cwd: Path, user: Path, *commands: list[str]) -> subprocess.CompletedProcess:
    """`sentemb FIT` run from `cwd`, then `sentemb EVALUATE` and `sentemb EXPORT` from `user`, as the installed
    command runs: `-P` keeps Python from putting the working directory on sys.path itself, and PYTHONPATH
    holds only this checkout (the installed package)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, "-P", "-c", USER_COMMANDS, json.dumps([str(user), *commands])],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # two fresh processes (the user's commands, sentence-transformers); the in-process checks
def test_the_docs_example_method_trains_evaluates_and_exports_from_the_users_folder(  # below are the fast path
    tiny_bert, sts_fixture, tmp_path, monkeypatch
):
    assert "examples/my_method.py" in (REPO / "docs" / "extending.md").read_text()  # the file the docs walk through
    user = tmp_path / "project"
    user.mkdir()
    for name in ("my_method.py", "my_method.yaml"):
        shutil.copy(REPO / "examples" / name, user / name)
    run = tmp_path / "run"
    best = run / "checkpoints" / "best.ckpt"
    # fit from the folder above: the module is found beside its config; evaluate and export from the user's
    # folder: the module is found in the working directory
    fit = ["fit", "-c", "project/my_method.yaml", "--model.init_args.backbone", tiny_bert, "--trainer.max_steps", "3",
           "--trainer.val_check_interval", "3", "--trainer.precision", "32", "--trainer.default_root_dir", str(run),
           "--trainer.accelerator", "cpu", "--data.batch_size", "8", "--data.data_dir", str(sts_fixture),
           "--data.cache_dir", str(tmp_path / "cache"), "--data.val_tasks", "[STSBenchmark-dev]",
           "--trainer.enable_model_summary", "false"]
    scores, export = tmp_path / "scores.json", ["export", str(best), str(tmp_path / "export")]
    done = sentemb(tmp_path, user, fit, ["evaluate", "--model", str(best), "--data-dir", str(sts_fixture), "--output",
                                         str(scores)], export)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SymmetricSimCSE" in done.stdout + done.stderr
    metrics = (run / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert "train/positive_cosine" in metrics.splitlines()[0]  # the method's extra log
    assert torch.load(best, weights_only=False)["sentemb_method"] == "my_method.SymmetricSimCSE"
    assert "STSBenchmark" in json.loads(scores.read_text())["sts"]

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
