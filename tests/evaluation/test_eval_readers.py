"""Transfer and clustering readers on small files that reproduce each quirk of the real data."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_sentemb.data.clustering import (
    CLUSTERING_TASKS,
    load_clustering_task,
    read_agnews_csv,
    read_dbpedia_csv,
    read_short_text_file,
)
from lightning_sentemb.data.paths import MissingDataError
from lightning_sentemb.data.transfer import (
    TRANSFER_TASKS,
    load_transfer_task,
    read_binary_task,
    read_mrpc_file,
    read_sst_file,
    read_trec_file,
)


def test_binary_task_latin1_whitespace_and_blank_lines(tmp_path: Path):
    (tmp_path / "a.pos").write_bytes(b"caf\xe9  is   good\n\nnice\tone\n")  # Latin-1 byte, a blank line (CR has some)
    (tmp_path / "a.neg").write_bytes(b"bad\n")
    data = read_binary_task(tmp_path / "a.pos", tmp_path / "a.neg")
    assert data.sentences == ["café is good", "", "nice one", "bad"]
    assert data.labels.tolist() == [1, 1, 1, 0]


def test_sst_reader_and_error_names_the_file(tmp_path: Path):
    path = tmp_path / "sentiment-dev"
    path.write_text("it 's  charming . \t1\nbleak\t0\n", encoding="utf-8")
    data = read_sst_file(path)
    assert data.sentences == ["it 's charming .", "bleak"]
    assert data.labels.tolist() == [1, 0]
    path.write_text("no label here\n", encoding="utf-8")
    with pytest.raises(ValueError, match="sentiment-dev:1"):
        read_sst_file(path)


def test_trec_reader_latin1_coarse_labels(tmp_path: Path):
    path = tmp_path / "train_5500.label"
    path.write_bytes(b"NUM:dist How far is it ?\nHUM:ind Who was sister\xf0city ?\nDESC:def What is  it ?\n")
    data = read_trec_file(path)
    assert data.sentences == ["How far is it ?", "Who was sisterðcity ?", "What is it ?"]
    assert data.labels.tolist() == [5, 3, 1]
    path.write_text("XYZ:foo bar\n")
    with pytest.raises(ValueError, match="train_5500.label:1"):
        read_trec_file(path)


def test_mrpc_reader_bom_and_header(tmp_path: Path):
    path = tmp_path / "msr_paraphrase_train.txt"
    body = "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t1\t2\tA  b .\tA b !\n0\t3\t4\tc\td\n"
    path.write_bytes(b"\xef\xbb\xbf" + body.encode("utf-8"))
    data = read_mrpc_file(path)
    assert (data.first, data.second, data.labels.tolist()) == (["A b .", "c"], ["A b !", "d"], [1, 0])
    path.write_text(body.split("\n", 1)[1], encoding="utf-8")  # header missing
    with pytest.raises(ValueError, match="header"):
        read_mrpc_file(path)


def test_transfer_layout_splits(eval_data: Path):
    assert set(load_transfer_task("MR", eval_data)) == {"all"}
    assert set(load_transfer_task("SST2", eval_data)) == {"train", "dev", "test"}
    assert set(load_transfer_task("TREC", eval_data)) == {"train", "test"}
    mrpc = load_transfer_task("MRPC", eval_data)
    assert len(mrpc["train"].first) == len(mrpc["train"].labels) == 40
    with pytest.raises(ValueError, match="unknown transfer task 'SST5'"):
        load_transfer_task("SST5", eval_data)
    assert len(TRANSFER_TASKS) == 7


def test_missing_transfer_file_names_the_path(tmp_path: Path):
    with pytest.raises(MissingDataError, match="rt-polarity.pos"):
        load_transfer_task("MR", tmp_path)


def test_short_text_crlf_trailing_tab_and_no_final_newline(tmp_path: Path):
    path = tmp_path / "stackoverflow_true_text"
    path.write_bytes(b"18\tHow do I fill a DataSet ?\t\r\n3\tBest clients\t\r\n3\tlast line")
    data = read_short_text_file(path)
    assert data.sentences == ["How do I fill a DataSet ?", "Best clients", "last line"]
    assert data.labels.tolist() == [18, 3, 3]
    path.write_text("no tab here\n")
    with pytest.raises(ValueError, match="stackoverflow_true_text:1"):
        read_short_text_file(path)


def test_dbpedia_csv_quoted_commas(tmp_path: Path):
    path = tmp_path / "test.csv"
    path.write_text('"1","Thomas, an artist ""quoted"""\n"14","A film."\n', encoding="utf-8")
    data = read_dbpedia_csv(path)
    assert data.sentences == ['Thomas, an artist "quoted"', "A film."]
    assert data.labels.tolist() == [1, 14]


def test_agnews_csv_header_and_backslash_breaks(tmp_path: Path):
    path = tmp_path / "test.csv"
    path.write_text('Class Index,Title,Description\n3,"Fears for pension","A second\\team, of rockets"\n')
    data = read_agnews_csv(path)
    assert data.sentences == ["Fears for pension A second team, of rockets"]
    assert data.labels.tolist() == [3]
    path.write_text('3,"no header","x"\n')
    with pytest.raises(ValueError, match="header"):
        read_agnews_csv(path)


def test_every_clustering_task_loads_from_the_layout(eval_data: Path):
    for name in CLUSTERING_TASKS:
        data = load_clustering_task(name, eval_data)
        assert len(data.sentences) == len(data.labels) == 45, name
        assert sorted(set(data.labels.tolist())) == [1, 2, 3], name
        assert all(s and not s.endswith(("\t", "\r")) for s in data.sentences), name
    with pytest.raises(ValueError, match="unknown clustering task"):
        load_clustering_task("Reuters", eval_data)
