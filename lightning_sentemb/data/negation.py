"""SNCSE's soft negatives (Wang et al., 2022): the negation of each training sentence, made by the rule
of the reference's `generate_soft_negative_samples.py` (github.com/Sense-GVT/SNCSE) over a dependency
parse, and `sentemb data negate`, which writes a corpus with the negations beside the sentences.

The rules read a small record per token (`Token`: text, Penn Treebank tag, dependency label, lemma),
so they run and are tested without a parser; spaCy (the `negate` extra, plus an English pipeline such
as `en_core_web_sm`, the reference's) makes the records from text (`spacy_tokens`). Without spaCy,
`lexicon_tokens` marks auxiliaries from a word list (demos and tests: cruder negations, see there). The
reference's rule, in order:

1. The sentence has a token "not": remove the first one (the negation of a negative sentence).
2. Else, at the first token that is an auxiliary (`aux`, `auxpass`) or the `ROOT`, whichever comes first:
   after an auxiliary, insert "not"; a root that is a form of "be" or a modal (`SPECIAL_WORDS`) gets
   "not" after it; a present or past root verb (VBP, VBZ, VBD) becomes "do/does/did not" + its lemma.
3. Otherwise (a root that is none of those: a noun, an infinitive, a participle): "Not" before the
   sentence, the reference's last resort (`fallback`; without it such a sentence is reported as not
   negatable).

The reference joins the tokens with single spaces ("the cat 's bowl ."), `spacing="tokens"` (default);
`spacing="original"` keeps the sentence's own spacing. It recognizes "not" only, so "isn't" gets
"is not n't"; `contractions=True` also removes "n't" (restoring "wo"/"ca" to "will"/"can").
"""

from __future__ import annotations

import csv
import io
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import tee
from pathlib import Path
from typing import IO, Any, Literal

from ..atomic_io import atomic_write
from ..console import progress_bar
from ..errors import SentEmbUserError
from .paths import require_file

__all__ = ["NEGATION_COLUMN", "Negation", "Token", "lexicon_tokens", "load_parser", "negate", "negate_file",
           "sentence_negator", "spacy_tokens", "summary"]

NEGATION_COLUMN = "negation"  # the corpus column SNCSE reads (csv header `sent0,negation`)
SPECIAL_WORDS = frozenset({"am", "is", "was", "are", "were", "can", "could", "will", "would", "shall", "should",
                           "may", "must", "might"})
DO_SUPPORT = {"VBP": "do", "VBZ": "does", "VBD": "did"}
CONTRACTED_HOSTS = {"wo": "will", "ca": "can", "sha": "shall"}  # "won't" = "wo" + "n't"
# the auxiliaries `lexicon_tokens` recognizes without a parser: be forms, modals, have forms
LEXICON_AUXILIARIES = SPECIAL_WORDS | {"has", "have", "had"}
INSTALL_HINT = ("pip install 'lightning_sentemb[negate]' && python -m spacy download en_core_web_sm (or name a "
                "pipeline folder; `lexicon` negates without a parser)")
Rule = Literal["removed_not", "aux", "copula_or_modal", "do_support", "not_prefix"]
Spacing = Literal["tokens", "original"]
RULE_NAMES: dict[str, str] = {"removed_not": "'not' removed", "aux": "'not' after the auxiliary",
                              "copula_or_modal": "'not' after a be/modal root",
                              "do_support": "do/does/did not + lemma", "not_prefix": "'Not' prefix (fallback)"}


@dataclass(frozen=True)
class Token:
    """One token as the rules read it: `tag` Penn Treebank (spaCy's `tag_`), `dep` the dependency label
    (spaCy's English `dep_`: ROOT, aux, auxpass, ...), `whitespace` what follows it in the text."""

    text: str
    tag: str
    dep: str
    lemma: str
    whitespace: str = " "


@dataclass(frozen=True)
class Negation:
    text: str
    rule: Rule


def negate(tokens: Sequence[Token], fallback: bool = True, contractions: bool = False,
           spacing: Spacing = "tokens") -> Negation | None:
    """The negation of a parsed sentence by the reference's rule (module docstring); None when the
    sentence has no token, or needs the "Not" prefix and `fallback` is off."""
    tokens = list(tokens)
    if not tokens:
        return None
    negative = ("not", "n't") if contractions else ("not",)
    found = next((i for i, token in enumerate(tokens) if token.text in negative), None)
    if found is not None:
        if found:  # the host keeps what followed the removed word ("can" + "not go": "can go")
            host = tokens[found - 1]
            text = CONTRACTED_HOSTS.get(host.text, host.text) if tokens[found].text == "n't" else host.text
            tokens[found - 1] = replace(host, text=text, whitespace=tokens[found].whitespace)
        return Negation(_join(tokens[:found] + tokens[found + 1 :], spacing), "removed_not")
    for i, token in enumerate(tokens):
        if token.dep in ("aux", "auxpass"):
            return Negation(_join(_edited(tokens, i, f"{token.text} not"), spacing), "aux")
        if token.dep == "ROOT":
            if token.text.lower() in SPECIAL_WORDS:
                return Negation(_join(_edited(tokens, i, f"{token.text} not"), spacing), "copula_or_modal")
            if token.tag in DO_SUPPORT:
                return Negation(_join(_edited(tokens, i, f"{DO_SUPPORT[token.tag]} not {token.lemma}"), spacing),
                                "do_support")
            break
    if not fallback:
        return None
    return Negation(_join([Token("Not", "RB", "neg", "not"), *tokens], spacing), "not_prefix")


def _edited(tokens: list[Token], index: int, text: str) -> list[Token]:
    return tokens[:index] + [replace(tokens[index], text=text)] + tokens[index + 1 :]


def _join(tokens: list[Token], spacing: Spacing) -> str:
    if spacing == "tokens":
        return " ".join(token.text for token in tokens)
    return "".join(token.text + token.whitespace for token in tokens).strip()


# ----- parsers: text -> token records -----------------------------------------------------------
Parser = Callable[[Iterable[str]], Iterator[list[Token]]]


def spacy_tokens(doc: Any) -> list[Token]:
    """The rule's records of a spaCy `Doc` (parsed by a pipeline, or built by hand with tags, deps,
    heads and lemmas)."""
    return [Token(t.text, t.tag_, t.dep_, t.lemma_, t.whitespace_) for t in doc]


def lexicon_tokens(sentence: str) -> list[Token]:
    """Records without a parser: the whitespace-separated words, those of `LEXICON_AUXILIARIES` marked
    as auxiliaries, nothing marked as the root. The rule then puts "not" after the first be, modal or
    have form and "Not" before the other sentences (no do-support: finding a finite verb needs a tagger)."""
    words = sentence.split()
    return [Token(word, "", "aux" if word.lower() in LEXICON_AUXILIARIES else "", word.lower()) for word in words]


def load_parser(name: str, batch_size: int = 256) -> Parser:
    """`lexicon` (`lexicon_tokens`), or a spaCy pipeline (name or folder; tagger, parser and lemmatizer,
    named entities off), one line when spaCy or the pipeline is missing."""
    if name == "lexicon":
        return lambda texts: map(lexicon_tokens, texts)
    try:
        import spacy
    except ImportError:
        raise SentEmbUserError(f"negating with the spaCy pipeline {name!r} needs spaCy, which is not installed: "
                               f"{INSTALL_HINT}") from None
    try:
        nlp = spacy.load(name, exclude=["ner"])
    except OSError:
        raise SentEmbUserError(f"{name}: no such spaCy pipeline is installed: {INSTALL_HINT}") from None
    return lambda texts: map(spacy_tokens, nlp.pipe(texts, batch_size=batch_size))


def sentence_negator(name: str) -> Callable[[list[str]], list[str]]:
    """The negation of each sentence by the reference's rule (fallback on), parsed by `load_parser(name)`:
    what `data.negate` adds to a corpus as it tokenizes it."""
    parse = load_parser(name)
    return lambda sentences: [negate(tokens).text for tokens in parse(sentences)]


# ----- files -------------------------------------------------------------------------------------
def negate_file(source: str | os.PathLike, output: str | os.PathLike, parse: Parser, fallback: bool = True,
                contractions: bool = False, spacing: Spacing = "tokens") -> Counter:
    """Write `output`, a csv with header `sent0,negation`, from `source` (one sentence a line); returns
    how many sentences each rule negated, with "not_negatable" (left out of the csv) and "blank" (blank
    lines, skipped)."""
    source = require_file(source, "sentences to negate")
    if Path(output).suffix != ".csv":
        raise SentEmbUserError(f"{output}: the output is a csv (sent0,{NEGATION_COLUMN}), name it *.csv")
    with open(source, "rb") as file:
        total = sum(1 for _ in file)
    counts: Counter = Counter()

    def write(file: IO[bytes]) -> None:
        text = io.TextIOWrapper(file, encoding="utf8", newline="")
        writer = csv.writer(text, lineterminator="\n")
        writer.writerow(["sent0", NEGATION_COLUMN])
        with progress_bar(total=total, desc=f"negate {source.name}", unit=" lines") as bar:
            sentences, to_parse = tee(_sentences(source, counts, bar))
            for sentence, tokens in zip(sentences, parse(to_parse), strict=True):
                negation = negate(tokens, fallback, contractions, spacing)
                counts[negation.rule if negation else "not_negatable"] += 1
                if negation is not None:
                    writer.writerow([sentence, negation.text])
        text.flush()
        text.detach()

    atomic_write(output, write)
    return counts


def _sentences(path: Path, counts: Counter, bar: Any) -> Iterator[str]:
    """The stripped non-blank lines, counting the blank ones and advancing the progress bar."""
    with open(path, encoding="utf8") as file:
        for line in file:
            bar.update(1)
            sentence = line.strip()
            if sentence:
                yield sentence
            else:
                counts["blank"] += 1


def summary(counts: Counter, output: str | os.PathLike) -> str:
    """One paragraph: how many sentences were negated, by which rule, and what was left out."""
    negated = sum(counts[rule] for rule in RULE_NAMES)
    considered = negated + counts["not_negatable"]
    rules = ", ".join(f"{name} {counts[rule]:,}" for rule, name in RULE_NAMES.items() if counts[rule])
    lines = [f"negated {negated:,} of {considered:,} sentences ({rules or 'none'}) into {output}"]
    if counts["not_negatable"]:
        lines.append(f"not negatable, left out: {counts['not_negatable']:,} (no auxiliary or finite root verb; "
                     "without --no-fallback they get 'Not' before them, as in the reference)")
    if counts["blank"]:
        lines.append(f"blank lines skipped: {counts['blank']:,}")
    return "\n".join(lines)

