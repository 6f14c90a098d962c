import pytest

from lightning_sentemb.data.corpus import read_corpus, tokenized_corpus
from lightning_sentemb.data.paths import MissingDataError
from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.data.senteval import STS_SUBSETS, load_sts_task, read_sick, read_stsb, read_sts_year


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


def test_corpus_skips_and_counts_blank_lines(corpus_file, capsys):
    columns = read_corpus(corpus_file)
    assert list(columns) == ["sent0"] and len(columns["sent0"]) == 40
    assert read_corpus(corpus_file, max_examples=7)["sent0"][-1] == "sentence number 6 is about dogs ."


def test_nli_csv_columns(tmp_path):
    path = tmp_path / "nli.csv"
    path.write_text('sent0,sent1,hard_neg\n"a, b",c,d\ne,f,g\n')
    assert read_corpus(path) == {"sent0": ["a, b", "e"], "sent1": ["c", "f"], "hard_neg": ["d", "g"]}
    bad = tmp_path / "bad.csv"
    bad.write_text("premise,hypothesis\nx,y\n")
    with pytest.raises(SentEmbUserError, match="bad.csv: an NLI csv needs a header"):
        read_corpus(bad)


def test_tokenized_corpus_is_cached_and_truncated(corpus_file, tiny_bert, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_bert)
    first = tokenized_corpus(corpus_file, tokenizer, max_tokens=4, cache_dir=tmp_path / "cache")
    assert len(first) == 40 and max(len(ids) for ids in first["sent0"]) == 4
    assert first[0]["sent0"] == tokenizer("sentence number 0 is", add_special_tokens=False)["input_ids"][:4]
    monkeypatch.setattr("lightning_sentemb.data.corpus.read_corpus", lambda *a, **k: pytest.fail("cache missed"))
    second = tokenized_corpus(corpus_file, tokenizer, max_tokens=4, cache_dir=tmp_path / "cache")
    assert second["sent0"] == first["sent0"]
    assert not list((tmp_path / "cache").glob("*.tmp"))
