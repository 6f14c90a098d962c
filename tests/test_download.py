import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lightning_sentemb.data.download import check_data_dir, download
from lightning_sentemb.data.senteval import load_sts_task

from .conftest import write_sts_fixture


def fake_hub(tmp_path_factory):
    """Stands in for hf_hub_download: serves senteval.tar (nested as SimCSE's is) and the corpora."""
    source = write_sts_fixture(tmp_path_factory.mktemp("source"))

    def hf_hub_download(repo_id, filename, repo_type, local_dir):
        target = f"{local_dir}/{filename}"
        if filename.endswith(".parquet"):  # all-nli's labelled SNLI + MNLI pairs
            assert (repo_id, repo_type, filename) == ("sentence-transformers/all-nli", "dataset",
                                                      "pair-class/train-00000-of-00001.parquet")
            Path(target).parent.mkdir(parents=True)
            pq.write_table(pa.table({"premise": ["a, b", "c"], "hypothesis": ["d", 'e "f"'], "label": [2, 0]}), target)
            return target
        assert (repo_id, repo_type) == ("princeton-nlp/datasets-for-simcse", "dataset")
        if filename == "senteval.tar":
            with tarfile.open(target, "w") as archive:
                archive.add(source / "senteval" / "downstream", arcname="SentEval/data/downstream")
        else:
            with open(target, "w") as handle:
                handle.write("sent0,sent1,hard_neg\na,b,c\n" if filename.endswith(".csv") else "a sentence\n")
        return target

    return hf_hub_download


def test_download_lays_out_the_data_dir(tmp_path, tmp_path_factory, monkeypatch, capsys):
    monkeypatch.setattr("huggingface_hub.hf_hub_download", fake_hub(tmp_path_factory))
    download(tmp_path / "data", ["senteval", "wiki1m", "nli"])
    assert len(load_sts_task("STSBenchmark", tmp_path / "data")) == 60
    assert (tmp_path / "data" / "corpora" / "nli_for_simcse.csv").read_text().startswith("sent0")
    assert check_data_dir(tmp_path / "data") == []
    assert not [p for p in (tmp_path / "data").rglob("tmp*")]
    download(tmp_path / "data", ["wiki1m"])
    assert "exists; skipped" in capsys.readouterr().out
    download(tmp_path / "data", ["allnli"])
    pairs = tmp_path / "data" / "corpora" / "allnli_pairs.csv"
    assert pairs.read_text() == 'premise,hypothesis,label\n"a, b",d,contradiction\nc,"e ""f""",entailment\n'
    assert check_data_dir(tmp_path / "data", required=["allnli"]) == []


def test_check_reports_missing_files_with_the_fetch_command(tmp_path, capsys):
    incomplete = check_data_dir(tmp_path, required=["sts", "nli"])
    assert incomplete == ["sts", "nli"]
    out = capsys.readouterr().out
    assert str(tmp_path / "corpora" / "nli_for_simcse.csv") in out
    assert f"sentemb data download --to {tmp_path} --what nli" in out


def test_unknown_item_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="unknown data item"):
        download(tmp_path, ["glue"])


def test_real_mirror_has_senteval_counts(shared_data):
    expected = {"STS12": 3108, "STS13": 1500, "STS14": 3750, "STS15": 3000, "STS16": 1186,
                "STSBenchmark": 1379, "SICKRelatedness": 4927, "STSBenchmark-dev": 1500, "SICKRelatedness-dev": 500}
    assert {name: len(load_sts_task(name, shared_data)) for name in expected} == expected
