import csv
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lightning.pytorch import Callback

from lightning_sentemb.data import corpus
from lightning_sentemb.data.corpus import CorpusReader, corpus_cache_path, open_tokenized_corpus, tokenize_corpus
from lightning_sentemb.data.paths import MissingDataError
from lightning_sentemb.data.senteval import STS_SUBSETS, load_sts_task, read_sick, read_sts_year, read_stsb
from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.methods.building import build_method


def test_sts_year_drops_unscored_pairs_and_normalizes_spaces(tmp_path):
    folder = tmp_path / "STS13-en-test"
    folder.mkdir()
    for subset in STS_SUBSETS["STS13"]:
        (folder / f"STS.input.{subset}.txt").write_text("a  b\tc d\ne f\tg h\ni j\tk   l\n")
        (folder / f"STS.gs.{subset}.txt").write_text("1.5\n\n4\n")
    task = read_sts_year(folder, "STS13")
    assert len(task) == 6
    assert task.first[:2] == ["a b", "i j"] and task.second[1] == "k l"
    assert task.gold.tolist() == [1.5, 4.0] * 3
    assert task.subsets == ["FNWN", "FNWN", "headlines", "headlines", "OnWN", "OnWN"]


def test_stsb_splits_on_tabs_and_ignores_extra_columns(tmp_path):
    path = tmp_path / "sts-test.csv"
    path.write_text('g\tMSRvid\t2012\t0001\t2.5\tHe said "hi , there"\tthey left\tsource\textra\n'
                    "g\tMSRvid\t2012\t0002\t0.0\ta\tb\n")
    task = read_stsb(path)
    assert task.first == ['He said "hi , there"', "a"] and task.second == ["they left", "b"]
    assert task.gold.tolist() == [2.5, 0.0]


def test_stsb_short_row_is_a_clear_error(tmp_path):
    path = tmp_path / "sts-test.csv"
    path.write_text("g\tMSRvid\t2012\t0001\t2.5\tonly one sentence\n")
    with pytest.raises(ValueError, match="sts-test.csv: expected at least 7"):
        read_stsb(path)


def test_sick_skips_header_and_handles_crlf(tmp_path):
    path = tmp_path / "SICK_test_annotated.txt"
    path.write_bytes(b"pair_ID\tsentence_A\tsentence_B\trelatedness_score\tentailment_judgment\r\n"
                     b"1\tA boy runs\tA kid runs\t4.5\tENTAILMENT\r\n2\tA cat\tA car\t1.2\tNEUTRAL\r\n")
    task = read_sick(path)
    assert task.first == ["A boy runs", "A cat"] and task.gold.tolist() == [4.5, 1.2]


def test_missing_file_names_path_and_fetch_command(tmp_path):
    with pytest.raises(MissingDataError) as error:
        load_sts_task("STSBenchmark", tmp_path)
    message = str(error.value)
    assert str(tmp_path / "senteval/downstream/STS/STSBenchmark/sts-test.csv") in message
    assert "sentemb data download --to" in message


def test_fixture_dir_loads_every_task(sts_fixture):
    task = load_sts_task("STS12", sts_fixture)
    assert len(task) == 5 * 5  # one blank gold line per subset
    assert len(load_sts_task("SICKRelatedness", sts_fixture)) == 12


def read_all(path, max_examples=None) -> tuple[dict[str, list[str]], CorpusReader]:
    """Every chunk of the reader joined into columns."""
    reader = CorpusReader(path, max_examples)
    columns: dict[str, list[str]] = {}
    for chunk in reader:
        for column, texts in chunk.items():
            columns.setdefault(column, []).extend(texts)
    return columns, reader


@pytest.fixture()
def small_chunks(monkeypatch):
    """Blocks of 64 bytes and chunks of 3 examples, so a few lines cross every boundary."""
    monkeypatch.setattr(corpus, "BLOCK_BYTES", 64)
    monkeypatch.setattr(corpus, "CHUNK_ROWS", 3)


def test_corpus_skips_and_counts_blank_lines(corpus_file):
    columns, reader = read_all(corpus_file)
    assert list(columns) == ["sent0"] and len(columns["sent0"]) == 40 and reader.blank_lines == 2
    columns, reader = read_all(corpus_file, max_examples=7)
    assert len(columns["sent0"]) == 7 and columns["sent0"][-1] == "sentence number 6 is about dogs ."


def test_streamed_lines_are_the_whole_files_lines(small_chunks, tmp_path):
    """Every line end `str.splitlines` knows, blank lines, and a line longer than a block, read in
    64-byte blocks and 3-line chunks: what reading the whole file gives."""
    text = ("first line\r\nsecond\rthird \u2028 fourth\n\n  \n" + "long " * 40 + "line\n"
            + "".join(f"sentence {i} caf\u00e9\n" for i in range(20)) + "no final newline")
    path = tmp_path / "corpus.txt"
    path.write_bytes(text.encode())
    lines = text.splitlines()
    expected = [line.strip() for line in lines if line.strip()]
    columns, reader = read_all(path)
    assert columns == {"sent0": expected}
    assert reader.blank_lines == len(lines) - len(expected) and reader.bytes_read == len(text.encode())
    assert [len(chunk["sent0"]) for chunk in CorpusReader(path)][:-1] == [3] * (len(expected) // 3)
    limited = [chunk["sent0"] for chunk in CorpusReader(path, max_examples=7)]
    assert limited == [expected[:3], expected[3:6], expected[6:7]]


@pytest.mark.parametrize("block", [64, 1 << 20])
def test_non_utf8_names_line_and_byte_offset_in_any_block(block, monkeypatch, tmp_path):
    monkeypatch.setattr(corpus, "BLOCK_BYTES", block)
    data = "".join(f"line {i} caf\u00e9\n" for i in range(30)).encode()
    bad = data + b"na\xefve .\n" + b"more .\n"
    path = tmp_path / "corpus.txt"
    path.write_bytes(bad)
    with pytest.raises(SentEmbUserError, match=rf"corpus.txt: not UTF-8 at line 31, byte offset {len(data) + 2} "
                                               r"\(byte 0xef\); re-encode"):
        read_all(path)


def test_nli_csv_columns(small_chunks, tmp_path):
    """Quoted fields with commas and line breaks, read across block boundaries, as the csv module
    reads the whole file."""
    rows = [{"sent0": f"premise {i}, with a comma", "sent1": f"entailed\n{i}", "hard_neg": f'said "no" {i}'}
            for i in range(12)]
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, ["sent0", "sent1", "hard_neg"])
    writer.writeheader()
    writer.writerows(rows)
    path = tmp_path / "nli.csv"
    path.write_text(buffer.getvalue(), newline="")
    columns, _ = read_all(path)
    assert columns == {column: [row[column] for row in rows] for column in ("sent0", "sent1", "hard_neg")}
    assert read_all(path, max_examples=4)[0]["sent1"] == [row["sent1"] for row in rows[:4]]
    bad = tmp_path / "bad.csv"
    bad.write_text("premise,hypothesis\nx,y\n")
    with pytest.raises(SentEmbUserError, match="bad.csv: a training csv needs a header with sent0"):
        read_all(bad)


@pytest.mark.parametrize("content", [b"", b"\n  \n", b"sent0,sent1\n"], ids=["empty", "blank", "header only"])
def test_a_corpus_without_examples_is_one_error_and_leaves_no_file(content, tiny_bert, tmp_path):
    from transformers import AutoTokenizer

    path = tmp_path / ("corpus.csv" if content.startswith(b"sent0") else "corpus.txt")
    path.write_bytes(content)
    with pytest.raises(SentEmbUserError, match="the training corpus holds no sentence"):
        tokenize_corpus(path, AutoTokenizer.from_pretrained(tiny_bert), 4, tmp_path / "cache")
    assert not list((tmp_path / "cache").iterdir())


def test_tokenized_corpus_is_cached_truncated_and_memory_mapped(corpus_file, tiny_bert, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_bert)
    cache = tokenize_corpus(corpus_file, tokenizer, max_tokens=4, cache_dir=tmp_path / "cache")
    assert cache == corpus_cache_path(corpus_file, tokenizer, 4, tmp_path / "cache")
    first = open_tokenized_corpus(cache)
    assert len(first) == 40 and max(len(ids) for ids in first["sent0"]) == 4
    assert first[0]["sent0"] == tokenizer("sentence number 0 is", add_special_tokens=False)["input_ids"][:4]
    assert first.cache_files == [{"filename": str(cache)}]  # opened from the file, not loaded into memory
    monkeypatch.setattr(corpus, "CorpusReader", lambda *a, **k: pytest.fail("cache missed"))
    assert tokenize_corpus(corpus_file, tokenizer, max_tokens=4, cache_dir=tmp_path / "cache") == cache
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [cache.name]
    assert corpus_cache_path(corpus_file, tokenizer, 5, tmp_path / "cache") != cache
    assert corpus_cache_path(corpus_file, tokenizer, 4, tmp_path / "cache", max_examples=7) != cache


@pytest.mark.parametrize("workers", [1, 2])
def test_tokenization_in_workers_equals_one_tokenizer_call(workers, small_chunks, tiny_bert, tmp_path):
    """Chunks of 3, in order, from 2 forked workers or in this process: the ids of one call over
    the whole corpus; NLI columns too."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_bert)
    sentences = [f"sentence {i} is {'about cats and dogs ' * (i % 4)}." for i in range(23)]
    path = tmp_path / "nli.csv"
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["sent0", "sent1"])
        writer.writerows(zip(sentences, reversed(sentences), strict=True))
    dataset = open_tokenized_corpus(tokenize_corpus(path, tokenizer, 6, tmp_path / "cache", workers=workers))
    for column, texts in (("sent0", sentences), ("sent1", sentences[::-1])):
        assert dataset[column] == [ids[:6] for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def test_workers_hold_at_most_two_chunks_each_in_flight(tiny_bert):
    from transformers import AutoTokenizer

    read = []

    def chunks():
        for i in range(20):
            read.append(i)
            yield {"sent0": [f"chunk {i}"]}

    tokenize = corpus.ChunkTokenizer(AutoTokenizer.from_pretrained(tiny_bert), 8)
    for done, _ in enumerate(corpus.tokenized_chunks(chunks(), tokenize, workers=2), start=1):
        assert len(read) - done <= 2 * 2
    assert done == 20


@pytest.mark.slow  # a fresh process, killed with -9
def test_workers_exit_when_the_run_is_killed(tiny_bert, tmp_path):
    """kill -9 of the tokenizing process: its workers notice the parent is gone and exit."""
    script = """
import os, sys, time
from pathlib import Path
from transformers import AutoTokenizer
from lightning_sentemb.data import corpus
tokenizer = AutoTokenizer.from_pretrained(sys.argv[2])
class Stalling(type(tokenizer)):
    def __call__(self, *args, **kwargs):
        Path(sys.argv[1], str(os.getpid())).touch()
        time.sleep(600)
tokenizer.__class__ = Stalling
corpus.tokenize_corpus(Path(sys.argv[1]) / "corpus.txt", tokenizer, 30, Path(sys.argv[1]) / "cache", workers=2)
"""
    (tmp_path / "corpus.txt").write_text("".join(f"sentence {i} .\n" for i in range(10_000)))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    process = subprocess.Popen([sys.executable, "-c", script, str(tmp_path), tiny_bert], env=env)
    try:
        for _ in range(600):
            workers = [int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()]
            if len(workers) == 2 or process.poll() is not None:
                break
            time.sleep(0.1)
        assert len(workers) == 2, f"the workers never started (exit code {process.poll()})"
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.wait()
    for _ in range(100):
        alive = [pid for pid in workers if _alive(pid)]
        if not alive:
            break
        time.sleep(0.1)
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, "workers outlived the killed run"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_prepare_data_tokenizes_and_setup_only_opens(tiny_bert, sts_fixture, tmp_path, monkeypatch):
    """What every rank runs (`setup`) never tokenizes: it opens what `prepare_data` wrote, and says
    where that is when it is not there."""
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import TrainerFn

    from lightning_sentemb.data.datamodule import SentEmbDataModule
    from lightning_sentemb.methods import SimCSE

    data = SentEmbDataModule(data_dir=str(sts_fixture), batch_size=4, cache_dir=str(tmp_path / "cache"),
                             prepare_data_per_node=False)
    assert data.prepare_data_per_node is False  # Lightning's switch: once per job instead of once per node
    data.trainer = SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.FITTING),
                                   lightning_module=build_method(SimCSE, tiny_bert), world_size=1)
    with pytest.raises(SentEmbUserError, match=r"wiki1m_for_simcse-\w+\.arrow: the tokenized training corpus is not "
                                               r"there; `prepare_data` writes it before `setup`"):
        data.setup("fit")
    data.prepare_data()
    monkeypatch.setattr(corpus, "CorpusReader", lambda *a, **k: pytest.fail("setup tokenized"))
    data.setup("fit")
    assert len(data.train_dataset) == 160
    assert data.train_dataset.cache_files[0]["filename"].startswith(str(tmp_path / "cache"))


def pickled_objects(obj: object) -> list[object]:
    """Every object `pickle` writes for `obj`."""
    import pickle

    seen: list[object] = []

    class Recording(pickle.Pickler):
        def persistent_id(self, o: object) -> None:
            seen.append(o)

    Recording(io.BytesIO()).dump(obj)
    return seen


@pytest.mark.parametrize("name", ["simcse_mlm", "promptbert", "conpvp"])
def test_the_collator_pickles_without_the_model_and_builds_the_same_batches(name, tiny_bert):
    """What a spawn or forkserver worker receives: no module, no tensor, and the same batches from the
    same per-batch seed (the draws: MLM masks, ConPVP's templates)."""
    import pickle

    import torch

    from lightning_sentemb.methods import ConPVP, PromptBERT, SimCSE

    build = {"simcse_mlm": lambda: build_method(SimCSE, tiny_bert, mlm_weight=0.5),
             "promptbert": lambda: build_method(PromptBERT, tiny_bert),
             "conpvp": lambda: build_method(ConPVP, tiny_bert)}[name]
    method = build()
    objects = pickled_objects(method.collator)
    assert not [o for o in objects if isinstance(o, (torch.nn.Module, torch.Tensor))]
    copy = pickle.loads(pickle.dumps(method.collator))
    examples = [{"sent0": ids} for ids in method.tokenizer(["a man plays a guitar", "the cat sat on the mat",
                                                            "two dogs run"], add_special_tokens=False)["input_ids"]]
    for collator in (method.collator, copy):
        collator.generator.manual_seed(7)
    want, got = method.collate(examples), copy(examples)
    assert want.keys() == got.keys()
    for key in ("features", "mlm"):
        for field in ("input_ids", "attention_mask"):
            if key in want:
                assert torch.equal(want[key][field], got[key][field])


@pytest.mark.slow  # a spawned interpreter; forked workers give the in-process batches in test_resume.py
def test_training_batches_under_the_spawn_start_method_equal_the_in_process_ones(tiny_bert):
    """A `spawn` worker (what a forkserver one also pickles) builds the in-process batches, template
    draws included."""
    import torch

    from lightning_sentemb.data.loader import ResumableBatchSampler, TrainLoader
    from lightning_sentemb.methods import ConPVP

    method = build_method(ConPVP, tiny_bert)
    ids = method.tokenizer([f"sentence {i} about {'cats' if i % 2 else 'dogs'}" for i in range(12)],
                           add_special_tokens=False)["input_ids"]
    dataset = [{"sent0": row} for row in ids]

    def batches(workers: int) -> list[torch.Tensor]:
        loader = TrainLoader(dataset, ResumableBatchSampler(len(dataset), 4, seed=5), method.collator, workers)
        if workers:
            loader.loader.multiprocessing_context = "spawn"
        return [batch["features"]["input_ids"] for batch in loader]

    in_process, spawned = batches(0), batches(1)
    assert len(in_process) == 3
    assert all(torch.equal(a, b) for a, b in zip(in_process, spawned, strict=True))


class StopAtSecondStep(Callback):
    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == 2:
            raise RuntimeError("stopped at step 2")


@pytest.mark.parametrize("ending", ["finished", "exception"])
def test_a_fit_stops_its_persistent_loader_workers_as_it_ends(ending, tiny_bert, sts_fixture, tmp_path):
    """Lightning sees the training DataLoader through `TrainLoader` and would leave its persistent workers
    running until the garbage collector got to the trainer (in the suite, a later test then waited minutes
    on their shutdown); the data module stops them when the fit ends, and when it stops on an exception
    (where Lightning calls no `teardown`)."""
    import multiprocessing

    from lightning_sentemb.lightning_cli import lightning_main
    from tests.test_end_to_end import fit_args

    before = {child.pid for child in multiprocessing.active_children()}
    args = ["fit", *fit_args(tiny_bert, sts_fixture, tmp_path, "--trainer.max_steps", "3", "--data.num_workers", "2",
                             "--data.persistent_workers", "true", "--data.val_tasks", "[STSBenchmark-dev]",
                             "--trainer.logger", "false")]
    if ending == "finished":
        lightning_main(args)
        assert (tmp_path / "checkpoints" / "last.ckpt").exists()
    else:
        with pytest.raises(RuntimeError, match="stopped at step 2"):
            lightning_main(args, callbacks=[StopAtSecondStep()])
    assert [child for child in multiprocessing.active_children() if child.pid not in before] == []
