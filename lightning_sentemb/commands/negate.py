"""`sentemb data negate`: SNCSE's soft negatives, the negation of each sentence of a corpus
(`data.negation`); its arguments are parsed before anything heavy is imported."""

from __future__ import annotations

import argparse


def add_negate_parser(sub: argparse._SubParsersAction) -> None:
    """`negate` as a subcommand of `sentemb data`."""
    negate = sub.add_parser("negate", help="write each sentence's negation beside it (SNCSE's soft negatives)",
                            description="Parses each line with spaCy and negates it by SNCSE's rule (docs/data.md); "
                                        "writes the csv sent0,negation that SNCSE trains on (data.train_file).")
    negate.add_argument("input", help="one sentence a line (.txt), e.g. wiki1m_for_simcse.txt")
    negate.add_argument("output", help="the .csv to write (header sent0,negation)")
    negate.add_argument("--parser", default="en_core_web_sm",
                        help="a spaCy pipeline, name or folder (default en_core_web_sm, the reference's), or lexicon: "
                             "no parser, auxiliaries from a word list and 'Not' before the other sentences (demos)")
    negate.add_argument("--no-fallback", dest="fallback", action="store_false",
                        help="leave out sentences without an auxiliary or a be/modal/finite root verb, instead of "
                             "writing 'Not' before them (the reference's last resort)")
    negate.add_argument("--contractions", action="store_true",
                        help="also remove \"n't\" as an existing negation (the reference removes 'not' only)")
    negate.add_argument("--spacing", choices=["tokens", "original"], default="tokens",
                        help="tokens: spaCy's tokens joined by single spaces (the reference); original: the "
                             "sentence's own spacing")
    negate.add_argument("--batch-size", type=int, default=256, help="sentences per spaCy batch")


def negate_command(options: argparse.Namespace) -> None:
    from ..data.negation import load_parser, negate_file, summary

    parse = load_parser(options.parser, options.batch_size)
    counts = negate_file(options.input, options.output, parse, options.fallback, options.contractions,
                         options.spacing)
    print(summary(counts, options.output))
