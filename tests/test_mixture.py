"""A mixture of training datasets (`data.datasets`): each format read through the corpus layer (tokenized
once, memory-mapped, per-side lengths), one-line errors, and fits of the existing methods on a mixture of one
format: each step's dataset logged (`train/loss/<name>`, the progress line), and a stopped fit resumed bit
for bit. The 2-process and kill -9 cases: tests/test_mixture_ddp.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.trainer.states import TrainerFn

from lightning_sentemb.build import build_method
from lightning_sentemb.data.datamodule import SentEmbDataModule
from lightning_sentemb.data.mixture import MixtureDataset, MixtureSource, parse_datasets
from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.lightning_cli import lightning_main
from lightning_sentemb.methods import SimCSE
from tests.test_resume import RecordLosses, TerminateAt, read_losses, trained_state

WORDS = ["cats", "dogs", "birds", "fish", "kids"]


def sentence(i: int, extra: str = "") -> str:
    return f"sentence {i} is about {WORDS[i % 5]} and {WORDS[i * 3 % 5]}{extra} ."


def write_files(folder: Path) -> dict[str, Path]:
    """The four file types, 12 examples each."""
    files = {name: folder / name for name in ("wiki.txt", "nli.csv", "retrieval.jsonl", "sts.parquet")}
    files["wiki.txt"].write_text("".join(sentence(i) + "\n" for i in range(12)))
    files["nli.csv"].write_text("sent0,sent1\n" + "".join(f"{sentence(i)},{sentence(i, ' too')}\n" for i in range(12)))
    files["retrieval.jsonl"].write_text("".join(
        json.dumps({"query": sentence(i), "pos": [sentence(i, " here"), "unused"],
                    "neg": [sentence(i + 1), sentence(i + 2), sentence(i + 3)]}) + "\n" for i in range(12)))
    pq.write_table(pa.table({"q": [sentence(i) for i in range(12)], "d": [sentence(i, " as well") for i in range(12)]}),
                   files["sts.parquet"])
    return files


def prepared(datasets: dict, data_dir: Path, cache: Path, backbone: str, **options) -> SentEmbDataModule:
    data = SentEmbDataModule(datasets=datasets, data_dir=str(data_dir), batch_size=4, cache_dir=str(cache), **options)
    data.trainer = SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.FITTING),
                                   lightning_module=build_method(SimCSE, backbone), world_size=1)
    data.prepare_data()
    data.setup("fit")
    return data


def test_each_format_is_read_tokenized_once_and_memory_mapped(tiny_bert, tmp_path):
    files = write_files(tmp_path)
    datasets = {"wiki": {"path": "wiki.txt", "format": "sentences"},
                "nli": {"path": str(files["nli.csv"]), "format": "pairs", "instruction": "Find a paraphrase"},
                "retrieval": {"path": "retrieval.jsonl", "format": "triplets", "query_max_len": 5, "doc_max_len": 7,
                              "columns": {"sent0": "query", "sent1": "pos", "hard_neg": "neg"},
                              "in_batch_negatives": False},
                "sts": {"path": "sts.parquet", "format": "pairs", "columns": {"sent0": "q", "sent1": "d"}}}
    data = prepared(datasets, tmp_path, tmp_path / "cache", tiny_bert)
    mixture = data.train_dataset
    assert isinstance(mixture, MixtureDataset) and mixture.sizes == [12, 12, 12, 12]
    assert [d.column_names for d in mixture.datasets] == [
        ["sent0"], ["sent0", "sent1"], ["sent0", "sent1", "hard_neg_1", "hard_neg_2", "hard_neg_3"], ["sent0", "sent1"]]
    for dataset in mixture.datasets:  # opened from its cache file, not loaded into memory
        assert len(dataset.cache_files) == 1 and dataset.cache_files[0]["filename"].startswith(str(tmp_path / "cache"))
    tokenizer = data.method.tokenizer
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    example = mixture[(2, 4)]
    # BERT's 2 special tokens come off each side's length; a list field: its first entry, negatives numbered
    assert example["sent0"] == ids(sentence(4))[:3] and example["sent1"] == ids(sentence(4, " here"))[:5]
    assert example["hard_neg_3"] == ids(sentence(7))[:5]
    assert example["mixture"] == MixtureSource(2, "retrieval", "", (), False, 5, 7)
    # written in data.instruction_format (E5's by default) before it is tokenized
    assert mixture[(1, 0)]["mixture"].instruction_ids == tuple(ids("Instruct: Find a paraphrase\nQuery: "))
    assert mixture[(3, 11)]["sent1"] == ids(sentence(11, " as well"))
    assert "mixture" not in prepared(None, tmp_path, tmp_path / "cache", tiny_bert,
                                     train_file="nli.csv").train_dataset[0]  # a plain train_file: as before


@pytest.mark.parametrize(("datasets", "error"), [
    ({}, "data.datasets needs at least one dataset"),
    ({"a": {"format": "pairs"}}, "data.datasets.a needs a path"),
    ({"a": {"path": "x.csv", "format": "qa"}}, "data.datasets.a.format is 'qa'; use one of sentences, pairs"),
    ({"a": {"path": "x.csv", "weigth": 2}}, "data.datasets.a: unknown key.s. weigth; the keys are path"),
    ({"a": {"path": "x.csv", "weight": 0}}, "data.datasets.a.weight is 0; a weight is a positive number"),
    ({"a": {"path": "x.csv", "weight": "high"}}, "data.datasets.a.weight is 'high'"),
    ({"a": {"path": "x.txt", "columns": {"sent0": "q"}}}, "data.datasets.a.columns maps the fields of a .jsonl"),
    ({"a": {"path": "x.txt", "query_max_len": "long"}}, "data.datasets.a.query_max_len is 'long'"),
])
def test_a_bad_dataset_entry_is_one_line(datasets, error):
    with pytest.raises(SentEmbUserError, match=error):
        parse_datasets(datasets)


def test_a_dataset_that_cannot_train_is_one_line(tiny_bert, tmp_path):
    write_files(tmp_path)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "gap.jsonl").write_text(json.dumps({"query": "a"}) + "\n" + json.dumps({"pos": "b"}) + "\n")
    cases = [({"w": {"path": "wiki.txt", "format": "pairs"}},
              r"data.datasets.w \(.*wiki.txt\): format pairs reads sent0, sent1, but the dataset has no column sent1"),
             ({"n": {"path": "nli.csv", "format": "sentences"}}, "has columns beyond the format .sent1."),
             ({"e": {"path": "empty.jsonl"}}, "empty.jsonl: the training corpus holds no sentence"),
             ({"g": {"path": "gap.jsonl", "columns": {"sent0": "query"}}}, r"gap.jsonl: row 2 has no field 'query'"),
             ({"w": {"path": "wiki.txt"}, "s": {"path": "nli.csv", "query_max_len": 2}},
              "data.datasets.s.query_max_len leaves no token after the 2 special token"),
             ({"w": "wiki.txt"}, None)]
    for datasets, error in cases:
        if error is None:  # 12 examples, batch 4 on 4 devices
            with pytest.raises(SentEmbUserError, match=r"data.datasets.w \(.*\): 12 training example.s., fewer than"):
                data = SentEmbDataModule(datasets=datasets, data_dir=str(tmp_path), batch_size=4,
                                         cache_dir=str(tmp_path / "cache"))
                data.trainer = SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.FITTING), world_size=4,
                                               lightning_module=build_method(SimCSE, tiny_bert))
                data.prepare_data()
                data.setup("fit")
            continue
        with pytest.raises(SentEmbUserError, match=error):
            prepared(datasets, tmp_path, tmp_path / "cache", tiny_bert)


class RecordDatasets(Callback):
    """Each step's dataset, and whether its own loss curve got this step's loss."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, bool]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        name = batch["dataset"].name
        metrics = trainer.callback_metrics
        self.steps.append((name, bool(metrics[f"train/loss/{name}"] == outputs["loss"].detach())))


def fit_args(backbone: str, data: Path, root: Path, datasets: dict, *extra: str) -> list[str]:
    return ["fit", "--model", "lightning_sentemb.methods.SimCSE", "--model.backbone", backbone,
            "--model.pooler", "cls", "--seed_everything", "7", "--data.data_dir", str(data),
            "--data.datasets", json.dumps(datasets), "--data.batch_size", "4",
            "--data.cache_dir", str(root.parent / "c"), "--data.val_tasks", "[STSBenchmark-dev]",
            "--trainer.default_root_dir", str(root), "--trainer.max_steps", "7", "--trainer.val_check_interval", "5",
            "--trainer.check_val_every_n_epoch", "null",
            "--trainer.enable_model_summary", "false", "--trainer.accelerator", "cpu", "--trainer.logger", "false",
            "--trainer.log_every_n_steps", "1", *extra]


def test_supervised_simcse_trains_on_a_mixture_of_pairs_and_resumes_bit_exact(tiny_bert, sts_fixture, tmp_path, capsys):
    files = write_files(tmp_path)
    datasets = {"nli": {"path": str(files["nli.csv"])},
                "sts": {"path": str(files["sts.parquet"]), "columns": {"sent0": "q", "sent1": "d"}, "weight": 2}}
    reference, recorded = tmp_path / "reference", RecordDatasets()
    lightning_main(fit_args(tiny_bert, sts_fixture, reference, datasets, "--data.mixture_sampling", "temperature"),
                   callbacks=[RecordLosses(str(tmp_path / "reference.jsonl")), recorded])
    # 3 + 3 batches an epoch; weights 1 : 2 at α 0.5 -> 2 and 4: the epoch of 6 steps, then one more
    assert [name for name, _ in recorded.steps].count("sts") in (4, 5) and all(logged for _, logged in recorded.steps)
    assert "dataset " in capsys.readouterr().out  # the progress line names the step's dataset
    root = tmp_path / "run"
    args = fit_args(tiny_bert, sts_fixture, root, datasets, "--data.mixture_sampling", "temperature",
                    "--trainer.enable_progress_bar", "false")
    with pytest.raises(SystemExit):
        lightning_main(args, callbacks=[RecordLosses(str(tmp_path / "run.jsonl")), TerminateAt(3)])
    lightning_main([*args, "--ckpt_path", "last"], callbacks=[RecordLosses(str(tmp_path / "run.jsonl"))])
    assert read_losses(tmp_path / "run.jsonl") == read_losses(tmp_path / "reference.jsonl")
    state, expected = trained_state(root), trained_state(reference)
    assert all(torch.equal(state[k], expected[k]) for k in expected)


def test_unsupervised_simcse_trains_on_a_mixture_of_sentences(tiny_bert, sts_fixture, tmp_path):
    (tmp_path / "a.txt").write_text("".join(sentence(i) + "\n" for i in range(8)))
    (tmp_path / "b.txt").write_text("".join(sentence(i, " again") + "\n" for i in range(8)))
    recorded = RecordDatasets()
    datasets = {"a": str(tmp_path / "a.txt"), "b": str(tmp_path / "b.txt")}
    lightning_main(fit_args(tiny_bert, sts_fixture, tmp_path / "run", datasets,
                            "--data.mixture_sampling", "round_robin", "--trainer.max_steps", "4",
                            "--trainer.enable_progress_bar", "false"), callbacks=[recorded])
    assert recorded.steps == [("a", True), ("b", True)] * 2


def test_senteval_corpora_of_the_demo_mixture(shared_data, tmp_path):
    """`senteval:snli-entailment` and `senteval:stsb-pairs` (experiments/demo/mixture.yaml), written once."""
    import csv

    from lightning_sentemb.data.senteval_corpora import derived_corpus_file

    snli = derived_corpus_file("snli-entailment", shared_data, tmp_path)
    rows = list(csv.DictReader(snli.open()))
    assert len(rows) == 6697 and rows[0] == {"sent0": "Two women are embracing while holding to go packages .",
                                             "sent1": "Two woman are holding packages ."}
    stsb = list(csv.DictReader(derived_corpus_file("stsb-pairs", shared_data, tmp_path).open()))
    assert len(stsb) == 1406
    assert stsb[0] == {"sent0": "a plane is taking off .", "sent1": "an air plane is taking off ."}
    assert derived_corpus_file("snli-entailment", shared_data, tmp_path) == snli and len(list(tmp_path.iterdir())) == 2
    with pytest.raises(SentEmbUserError, match="senteval:snli: no such corpus; the SentEval-derived corpora are "
                                               "senteval:sts, senteval:snli-entailment, senteval:stsb-pairs"):
        derived_corpus_file("snli", shared_data, tmp_path)


@pytest.mark.slow  # three interpreters loading MiniLM
def test_the_mixture_benchmark_runs_on_tiny_sizes(capfd):
    """`benchmarks/mixture.py` (`make bench`) end to end on 600 lines: both measurements come back."""
    from tests.launch import REPO, run_script

    capfd.readouterr()
    run_script(REPO / "benchmarks" / "mixture.py", "--lines", "600", "--datasets", "2", "--batches", "2", "--rounds",
               "1")
    printed = capfd.readouterr().out
    result = json.loads(printed[printed.index("{"):])
    assert result["step time"]["ratio mixture / one file"] > 0
    assert result["memory (MiB)"]["ratios against one dataset"]["VmHWM"] > 0


def test_the_progress_bar_shows_the_dataset_a_step_drew(monkeypatch):
    from lightning.pytorch.callbacks import RichProgressBar
    from lightning.pytorch.callbacks.progress.rich_progress import MetricsTextColumn

    from lightning_sentemb import console

    bar = console.SentEmbProgressBar("val/STSBenchmark-dev")
    monkeypatch.setattr(RichProgressBar, "on_train_batch_end", lambda *args: None)  # no live bar to refresh
    monkeypatch.setattr(console, "at_decision_step", lambda trainer: False)
    trainer = SimpleNamespace(progress_bar_metrics={}, loggers=[], max_epochs=-1, callback_metrics={})
    for name in ("nli", "stsb"):
        bar.on_train_batch_end(trainer, None, None, {"dataset": MixtureSource(1, name)}, 0)
    bar.on_train_batch_end(trainer, None, None, {"features": {}}, 0)  # a plain batch leaves it as it was
    column = MetricsTextColumn(trainer, "", " ", bar.theme.metrics_format)
    column.update(bar.get_metrics(trainer, None))
    assert list(column._generate_metrics_texts()) == ["dataset: stsb"]
