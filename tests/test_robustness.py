"""Inputs and outputs: a kill during a write leaves the previous file or none, concurrent writers,
one clear error for data that cannot train, outputs usable by a group, one file per figure."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from lightning_sentemb.atomic_io import atomic_write_json
from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.methods.building import build_method

REPO = Path(__file__).resolve().parents[1]
SENTENCES = ["a man plays guitar .", "the cat sleeps on the sofa all day long", "kids play football"]


# ----- kill -9 in the middle of a write -------------------------------------------------------------

BLOCK = """
import os, sys, time
from pathlib import Path
def block(*_args):  # the writer stops here, its output half done, until the test kills it
    Path(sys.argv[1]).touch()
    time.sleep(600)
"""

KILLED_WRITERS = {
    # the whole payload is in the temporary file, only the rename is left
    "results JSON": BLOCK + """
from lightning_sentemb.atomic_io import atomic_write_json
os.fsync = block
atomic_write_json(Path(sys.argv[2]) / "out.json", {"new": "x" * 1_000_000})
""",
    # the export folder holds one file of several when the writer stops
    "export": BLOCK + """
from lightning_sentemb.export import export
class HalfWritten:
    def write_export(self, folder, adapter_only=False):
        (folder / "config.json").write_text("{}")
        block()
export(HalfWritten(), Path(sys.argv[2]) / "export")
""",
    # the tokenizer (in this process) stops after the first 2000-sentence chunk has been written to the cache
    "tokenized corpus": BLOCK + """
from transformers import AutoTokenizer
from lightning_sentemb.data import corpus
tokenizer = AutoTokenizer.from_pretrained(sys.argv[3])
calls = []
class Stalling(type(tokenizer)):
    def __call__(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            block()
        return super().__call__(*args, **kwargs)
tokenizer.__class__ = Stalling
corpus.tokenize_corpus(Path(sys.argv[2]) / "corpus.txt", tokenizer, 30, Path(sys.argv[2]) / "cache", workers=1)
""",
}


def _run_and_kill(code: str, *args: str, marker: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([sys.executable, "-c", code, str(marker), *args], env=env, cwd=REPO)
    try:
        for _ in range(1200):
            if marker.exists() or process.poll() is not None:
                break
            time.sleep(0.1)
        assert marker.exists(), f"the writer never reached the hook (exit code {process.poll()})"
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.wait()


@pytest.mark.slow  # a fresh process per writer; the temporary-then-rename writes in-process: test_resume.py
@pytest.mark.parametrize("writer", KILLED_WRITERS)
def test_kill_9_during_a_write_leaves_the_previous_file_or_none(writer, tiny_bert, tmp_path):
    (tmp_path / "out.json").write_text('{"old": 1}\n')
    (tmp_path / "corpus.txt").write_text("".join(f"sentence {i} about cats .\n" for i in range(4500)))
    _run_and_kill(KILLED_WRITERS[writer], str(tmp_path), tiny_bert, marker=tmp_path / "marker")

    assert json.loads((tmp_path / "out.json").read_text()) == {"old": 1}
    assert not (tmp_path / "export").exists()
    if writer != "tokenized corpus":
        assert [p for p in tmp_path.iterdir() if p.name.startswith(".")], "the kill came in the middle of the write"
    if writer == "tokenized corpus":
        from transformers import AutoTokenizer

        from lightning_sentemb.data.corpus import open_tokenized_corpus, tokenize_corpus

        cache = tmp_path / "cache"
        assert any(p.stat().st_size for p in cache.iterdir()), "the kill came after some rows were written"
        assert not list(cache.glob("*.arrow")), "only a complete cache may carry the name a later run loads"
        tokenizer = AutoTokenizer.from_pretrained(tiny_bert)
        dataset = open_tokenized_corpus(tokenize_corpus(tmp_path / "corpus.txt", tokenizer, 30, cache))
        assert len(dataset) == 4500 and len(list(cache.glob("*.arrow"))) == 1


@pytest.mark.parametrize("tool", ["reproduce", "sweep"])
def test_an_interrupted_summary_leaves_the_previous_file(tool, tmp_path, monkeypatch):
    from lightning_sentemb import reproduce, sweep

    name, write = {
        "reproduce": ("reproduce.json", lambda: reproduce.report("m", {0: {"STS12": 1.0, "avg": 1.0}}, tmp_path)),
        "sweep": ("summary.json", lambda: sweep.report({"metric": {"name": "m", "goal": "maximize"}, "parameters": {}},
                                                       [], tmp_path)),
    }[tool]
    (tmp_path / name).write_text('{"old": 1}\n')

    def interrupted(_fd: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write()
    assert [p.name for p in tmp_path.iterdir()] == [name]
    assert json.loads((tmp_path / name).read_text()) == {"old": 1}


def test_two_writers_at_once_never_fail_and_leave_valid_json(tmp_path):
    path = tmp_path / "results.json"
    errors: list[BaseException] = []
    umask = os.umask(0o022)
    os.umask(umask)

    def hammer(writer: int) -> None:
        try:
            for n in range(150):
                atomic_write_json(path, {"writer": writer, "n": n, "payload": list(range(200))})
        except BaseException as error:  # noqa: BLE001 - the test reports every failure
            errors.append(error)

    threads = [threading.Thread(target=hammer, args=(w,)) for w in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert json.loads(path.read_text())["n"] == 149
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]
    assert os.umask(umask) == umask, "reading the umask must never change it, even for a moment"


# ----- runs that cannot train -------------------------------------------------------------------------

def _fit(backbone: str, data: Path, root: Path, *extra: str) -> None:
    from lightning_sentemb.lightning_cli import lightning_main

    lightning_main([
        "fit", "--model", "lightning_sentemb.methods.SimCSE", "--model.backbone", backbone,
        "--data.data_dir", str(data), "--data.batch_size", "8", "--data.cache_dir", str(root / "cache"),
        "--trainer.default_root_dir", str(root), "--trainer.max_steps", "2", "--trainer.logger", "false",
        "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu", *extra,
    ])


def _corpus(tmp_path: Path, content: bytes) -> str:
    path = tmp_path / "corpus.txt"
    path.write_bytes(content)
    return str(path)


BAD_RUNS = {
    "batch_size 1": (
        lambda tmp: ["--data.batch_size", "1"], r"data\.batch_size is 1: .* set --data\.batch_size 2 or more"
    ),
    "max_seq_len 0": (
        lambda tmp: ["--data.max_seq_len", "0"],
        r"data\.max_seq_len is 0, .* 2 special token\(s\); set --data\.max_seq_len 3",
    ),
    "max_seq_len = special tokens": (
        lambda tmp: ["--data.max_seq_len", "2"], r"data\.max_seq_len is 2, .*--data\.max_seq_len 3"
    ),
    "corpus smaller than one batch": (
        lambda tmp: ["--data.train_file", _corpus(tmp, b"one .\ntwo .\nthree .\n")],
        r"corpus\.txt: 3 training example\(s\), fewer than one batch \(data\.batch_size 8 x 1 device\(s\)\)",
    ),
    "empty corpus": (
        lambda tmp: ["--data.train_file", _corpus(tmp, b"")], r"corpus\.txt: the training corpus holds no sentence"
    ),
    "blank-only corpus": (
        lambda tmp: ["--data.train_file", _corpus(tmp, b"\n   \n\t\n")],
        r"corpus\.txt: the training corpus holds no sentence",
    ),
    "non-UTF-8 byte": (
        lambda tmp: ["--data.train_file", _corpus(tmp, "caf\u00e9 .\nok .\n".encode() + b"na\xefve .\n")],
        r"corpus\.txt: not UTF-8 at line 3, byte offset 15 \(byte 0xef\); re-encode the file as UTF-8",
    ),
}


@pytest.mark.parametrize("case", BAD_RUNS)
def test_a_run_that_cannot_train_stops_with_one_line(case, tiny_bert, sts_fixture, tmp_path):
    extra, message = BAD_RUNS[case]
    with pytest.raises(SentEmbUserError, match=message) as error:
        _fit(tiny_bert, sts_fixture, tmp_path, *extra(tmp_path))
    assert "\n" not in str(error.value)
    assert not list(tmp_path.rglob("*.ckpt"))


# ----- outputs on shared storage ---------------------------------------------------------------------

def test_export_and_report_respect_the_umask_like_cp(tiny_bert, tmp_path):
    from lightning_sentemb.evaluation.report import write_report
    from lightning_sentemb.export import export
    from lightning_sentemb.methods import SimCSE

    previous = os.umask(0o002)
    try:
        folder = export(build_method(SimCSE, tiny_bert, pooler="avg", mlp="none"), tmp_path / "export")
        written = write_report({"m": {"sts": {"STS12": 1.0, "avg": 1.0}}}, tmp_path / "report")
    finally:
        os.umask(previous)
    assert folder.stat().st_mode & 0o777 == 0o775
    files = [p for p in folder.rglob("*") if p.is_file()] + [written["json"], written["markdown"]]
    assert files and {p.name: p.stat().st_mode & 0o777 for p in files} == {p.name: 0o664 for p in files}


def test_model_labels_are_readable_and_unique():
    from lightning_sentemb.evaluation.report import model_labels

    assert model_labels(["out/simcse/checkpoints/best.ckpt", "out/promptbert/checkpoints/best.ckpt",
                         "bert-base-uncased", "princeton-nlp/sup-simcse-bert-base-uncased"]) == [
        "simcse/best", "promptbert/best", "bert-base-uncased", "princeton-nlp/sup-simcse-bert-base-uncased"]
    assert model_labels(["a/run/checkpoints/best.ckpt", "b/run/checkpoints/best.ckpt", "c/checkpoints/best.ckpt"]) == [
        "a/run/best", "b/run/best", "c/best"]
    assert model_labels(["x.ckpt", "y.ckpt"], ["mine", "theirs"]) == ["mine", "theirs"]
    with pytest.raises(SentEmbUserError, match="one distinct name per --model"):
        model_labels(["x.ckpt", "y.ckpt"], ["mine"])
    with pytest.raises(SentEmbUserError, match="name each with --name"):
        model_labels(["x.ckpt", "x.ckpt"])


# ----- our sentence-transformers modules --------------------------------------------------------------

@pytest.mark.parametrize(("method_name", "new_path", "old_path"), [
    ("PromptBERT", "lightning_sentemb.export.template.TemplateSentenceEncoder",
     "lightning_sentemb.export_template.TemplateSentenceEncoder"),
    ("DCPCSE", "lightning_sentemb.export.prefix.PrefixedTransformer",
     "lightning_sentemb.encoders.prefix_st.PrefixedTransformer"),
])
def test_an_export_naming_the_old_module_path_still_loads(method_name, new_path, old_path, tiny_bert, tmp_path):
    """Exports written before the modules moved into `lightning_sentemb.export` name the old path,
    which `lightning_sentemb._compat` keeps importable without a file there."""
    from sentence_transformers import SentenceTransformer

    from lightning_sentemb import methods
    from lightning_sentemb.export import export

    assert not (Path(methods.__file__).parents[1] / (old_path.rsplit(".", 1)[0].replace(".", "/") + ".py")).exists()
    torch.manual_seed(0)
    method = build_method(getattr(methods, method_name), tiny_bert)
    folder = export(method, tmp_path / "export")
    modules = json.loads((folder / "modules.json").read_text())
    assert modules[0]["type"] == new_path
    modules[0]["type"] = old_path
    (folder / "modules.json").write_text(json.dumps(modules))
    model = SentenceTransformer(str(folder), device="cpu", trust_remote_code=True)
    assert f"{type(model[0]).__module__}.{type(model[0]).__name__}" == new_path
    torch.testing.assert_close(model.encode(SENTENCES, convert_to_tensor=True), method.encode(SENTENCES),
                               atol=1e-5, rtol=1e-5)


def test_a_choice_outside_its_literal_is_one_line_when_built_in_python(tiny_bert):
    """The CLI checks a `Literal` annotation itself; a method built in Python gets the same one line."""
    from lightning_sentemb.methods import SimCSE
    from lightning_sentemb.methods.mntp import MNTP

    with pytest.raises(SentEmbUserError, match=r"^model\.init_args\.attn_implementation must be null or one of "
                                               r"padded, sdpa, eager, flash_attention_2, flex_attention, got 'flash'$"):
        build_method(SimCSE, tiny_bert, attn_implementation="flash")
    with pytest.raises(SentEmbUserError, match=r"^model\.init_args\.mask_replace must be one of bert, all, got None$"):
        build_method(MNTP, tiny_bert, mask_replace=None)
