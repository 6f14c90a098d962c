"""SNCSE's negator (`data.negation`): the reference's rule on parses written by hand (token, Penn tag,
dependency label, lemma: what spaCy's en_core_web_sm gives these sentences), so no spaCy pipeline is
downloaded; the same records from a spaCy `Doc` built in code (without a pipeline; skipped when spaCy
is absent); the parser-free lexicon; `sentemb data negate` and `data.negate`.

The cases: one sentence per branch of the reference's `convert_to_negation` (the SNCSE paper's own
examples could not be read offline, only its abstract; these are sentences of the paper's kind, a
sentence and its negation differing by "not"), both directions of one pair; sentences the rule must
leave alone (blank lines) or report as not negatable (no auxiliary, no be/modal/finite root, with the
fallback off)."""

from __future__ import annotations

import csv
import sys

import pytest
import torch

from lightning_sentemb.cli import main
from lightning_sentemb.data.negation import Token, lexicon_tokens, negate, negate_file, spacy_tokens, summary


def parse(*words: str) -> list[Token]:
    """Records from "text/TAG/dep/lemma" words, each followed by one space."""
    return [Token(*word.rsplit("/", 3)) for word in words]


# sentence: (parse, reference negation, rule)
CASES = {
    "A man is playing a guitar .": (
        parse("A/DT/det/a", "man/NN/nsubj/man", "is/VBZ/aux/be", "playing/VBG/ROOT/play", "a/DT/det/a",
              "guitar/NN/dobj/guitar", "./././."),
        "A man is not playing a guitar .", "aux"),
    "A man is not playing a guitar .": (
        parse("A/DT/det/a", "man/NN/nsubj/man", "is/VBZ/aux/be", "not/RB/neg/not", "playing/VBG/ROOT/play",
              "a/DT/det/a", "guitar/NN/dobj/guitar", "./././."),
        "A man is playing a guitar .", "removed_not"),
    "The film was released in 1999 .": (  # passive auxiliary
        parse("The/DT/det/the", "film/NN/nsubjpass/film", "was/VBD/auxpass/be", "released/VBN/ROOT/release",
              "in/IN/prep/in", "1999/CD/pobj/1999", "./././."),
        "The film was not released in 1999 .", "aux"),
    "She is a teacher .": (  # copula root
        parse("She/PRP/nsubj/she", "is/VBZ/ROOT/be", "a/DT/det/a", "teacher/NN/attr/teacher", "./././."),
        "She is not a teacher .", "copula_or_modal"),
    "He plays football .": (
        parse("He/PRP/nsubj/he", "plays/VBZ/ROOT/play", "football/NN/dobj/football", "./././."),
        "He does not play football .", "do_support"),
    "They live in Paris .": (
        parse("They/PRP/nsubj/they", "live/VBP/ROOT/live", "in/IN/prep/in", "Paris/NNP/pobj/Paris", "./././."),
        "They do not live in Paris .", "do_support"),
    "The team won the cup .": (
        parse("The/DT/det/the", "team/NN/nsubj/team", "won/VBD/ROOT/win", "the/DT/det/the", "cup/NN/dobj/cup",
              "./././."),
        "The team did not win the cup .", "do_support"),
    # the first of aux and ROOT decides: the root "said" comes before the clause's auxiliary "would"
    "He said he would come .": (
        parse("He/PRP/nsubj/he", "said/VBD/ROOT/say", "he/PRP/nsubj/he", "would/MD/aux/would",
              "come/VB/ccomp/come", "./././."),
        "He did not say he would come .", "do_support"),
    "A list of episodes .": (  # no verb: the reference's last resort
        parse("A/DT/det/a", "list/NN/ROOT/list", "of/IN/prep/of", "episodes/NNS/pobj/episode", "./././."),
        "Not A list of episodes .", "not_prefix"),
}


@pytest.mark.parametrize("sentence", list(CASES))
def test_each_rule_of_the_reference(sentence: str) -> None:
    tokens, expected, rule = CASES[sentence]
    negation = negate(tokens)
    assert (negation.text, negation.rule) == (expected, rule)


def test_negating_twice_gives_the_sentence_back_where_not_was_inserted() -> None:
    _, negation, _ = CASES["A man is playing a guitar ."]
    assert negation in CASES and negate(CASES[negation][0]).text == "A man is playing a guitar ."


def test_not_negatable_without_the_fallback_and_nothing_for_an_empty_parse() -> None:
    tokens, _, _ = CASES["A list of episodes ."]
    assert negate(tokens, fallback=False) is None
    assert negate([]) is None and negate([], fallback=True) is None


def test_spacing_and_contractions() -> None:
    # "The dog's bowl isn't empty." as spaCy tokenizes it, with each token's trailing whitespace
    words = [("The", "DT", "det", "the", " "), ("dog", "NN", "poss", "dog", ""), ("'s", "POS", "case", "'s", " "),
             ("bowl", "NN", "nsubj", "bowl", " "), ("is", "VBZ", "ROOT", "be", ""), ("n't", "RB", "neg", "not", " "),
             ("empty", "JJ", "acomp", "empty", ""), (".", ".", "punct", ".", "")]
    tokens = [Token(*word) for word in words]
    assert negate(tokens).text == "The dog 's bowl is not n't empty ."  # the reference: "not" only
    assert negate(tokens, contractions=True).text == "The dog 's bowl is empty ."
    assert negate(tokens, contractions=True, spacing="original").text == "The dog's bowl is empty."
    wont = [Token("It", "PRP", "nsubj", "it"), Token("wo", "MD", "aux", "will", ""), Token("n't", "RB", "neg", "not"),
            Token("rain", "VB", "ROOT", "rain", "")]
    assert negate(wont, contractions=True, spacing="original").text == "It will rain"
    cannot = [Token("I", "PRP", "nsubj", "I"), Token("can", "MD", "aux", "can", ""), Token("not", "RB", "neg", "not"),
              Token("go", "VB", "ROOT", "go", "")]
    assert negate(cannot, spacing="original").text == "I can go"


def test_records_from_a_spacy_doc_built_without_a_pipeline() -> None:
    spacy = pytest.importorskip("spacy")
    tokens, expected, _ = CASES["He plays football ."]
    doc = spacy.tokens.Doc(spacy.vocab.Vocab(), words=[t.text for t in tokens], spaces=[True, True, False, False],
                           tags=[t.tag for t in tokens], deps=[t.dep for t in tokens], heads=[1, 1, 1, 1],
                           lemmas=[t.lemma for t in tokens])
    records = spacy_tokens(doc)
    assert [(r.text, r.tag, r.dep, r.lemma) for r in records] == [(t.text, t.tag, t.dep, t.lemma) for t in tokens]
    assert negate(records).text == expected
    assert negate(records, spacing="original").text == "He does not play football."


def test_the_lexicon_needs_no_parser() -> None:
    assert negate(lexicon_tokens("The film was released in 1999 .")).text == "The film was not released in 1999 ."
    assert negate(lexicon_tokens("It has been raining")).text == "It has not been raining"
    negation = negate(lexicon_tokens("He plays football ."))
    assert (negation.text, negation.rule) == ("Not He plays football .", "not_prefix")


def test_negate_file_writes_the_csv_and_counts(tmp_path) -> None:
    source = tmp_path / "corpus.txt"
    sentences = ["A man is playing a guitar .", "He plays football .", "A list of episodes ."]
    source.write_text(f"{sentences[0]}\n\n{sentences[1]}\n   \n{sentences[2]}\n")
    output = tmp_path / "negated.csv"

    def parse_by_hand(texts):
        return (CASES[text][0] for text in texts)

    counts = negate_file(source, output, parse_by_hand, fallback=False)
    with output.open(newline="") as file:
        assert list(csv.reader(file)) == [["sent0", "negation"], [sentences[0], CASES[sentences[0]][1]],
                                          [sentences[1], CASES[sentences[1]][1]]]
    assert counts == {"aux": 1, "do_support": 1, "not_negatable": 1, "blank": 2}
    text = summary(counts, output)
    assert text.startswith("negated 2 of 3 sentences ('not' after the auxiliary 1, do/does/did not + lemma 1) "
                           f"into {output}")
    assert "not negatable, left out: 1" in text and "blank lines skipped: 2" in text


def test_data_negate_without_spacy_is_one_line(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "corpus.txt").write_text("A man is playing a guitar .\n")
    monkeypatch.setitem(sys.modules, "spacy", None)  # import spacy fails
    with pytest.raises(SystemExit) as stop:
        main(["data", "negate", str(tmp_path / "corpus.txt"), str(tmp_path / "out.csv")])
    assert stop.value.code == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line
    assert line.startswith("sentemb: error: negating with the spaCy pipeline 'en_core_web_sm' needs spaCy, which is "
                           "not installed: pip install 'lightning_sentemb[negate]'")


def test_data_negate_lexicon_and_the_data_option_write_the_same_column(tmp_path, tiny_bert, capsys) -> None:
    from transformers import AutoTokenizer

    from lightning_sentemb.data.corpus import open_tokenized_corpus, tokenize_corpus

    source = tmp_path / "corpus.txt"
    source.write_text("The film was released in 1999 .\nHe plays football .\n")
    main(["data", "negate", str(source), str(tmp_path / "out.csv"), "--parser", "lexicon"])
    assert capsys.readouterr().out.startswith("negated 2 of 2 sentences")
    tokenizer = AutoTokenizer.from_pretrained(tiny_bert)
    from_option = open_tokenized_corpus(tokenize_corpus(source, tokenizer, 16, tmp_path / "cache", negate="lexicon",
                                                                   workers=1))
    from_file = open_tokenized_corpus(tokenize_corpus(tmp_path / "out.csv", tokenizer, 16, tmp_path / "cache",
                                                                 workers=1))
    assert from_option.column_names == from_file.column_names == ["sent0", "negation"]
    assert from_option[:] == from_file[:]
    assert tokenizer.decode(from_option[0]["negation"]) == "the film was not released in 1999."
    assert torch.tensor(from_option[1]["negation"]).numel() > torch.tensor(from_option[1]["sent0"]).numel()
