"""`sentemb data mine`: its arguments (parsed before any heavy import); the work is `mining.mine_command`."""

from __future__ import annotations

import argparse

from . import TRUST_HELP


def add_mine_parser(sub: argparse._SubParsersAction) -> None:
    """`mine` as a subcommand of `sentemb data`."""
    mine = sub.add_parser("mine",
                          help="mine hard negatives for (anchor, positive) pairs with a model; write a training csv",
                          description="Candidates: the file's distinct positives, ranked by cosine (faiss); ranks, "
                                      "margin and score filter them (docs/negatives.md).")
    mine.add_argument("pairs", help=".csv with header sent0,sent1 (or anchor,positive), .jsonl of such objects, "
                      "or an STS Benchmark file (with --min-score)")
    mine.add_argument("--model", required=True, help="checkpoint (.ckpt), export, HF folder, hub name or pkg:MODULE")
    mine.add_argument("--output", required=True, help="the .csv that the supervised configs read (data.train_file)")
    mine.add_argument("--output-format", choices=["columns", "triplets"], default="columns",
                      help="columns (default): one row a pair, sent0,sent1,hard_neg or with --num-negatives k "
                           "sent0,sent1,hard_neg_1..hard_neg_k (pairs with fewer dropped); triplets: one "
                           "sent0,sent1,hard_neg row a negative")
    mine.add_argument("--min-score", type=float, default=None,
                      help="an STS Benchmark file's pairs scored at least this are the (anchor, positive) pairs")
    mine.add_argument("--pooler", default=None, help="pooling for HF folders, as in `sentemb evaluate`")
    mine.add_argument("--num-negatives", type=int, default=1, help="negatives per pair (default 1)")
    mine.add_argument("--range-min", type=int, default=0, help="skip the first ranks (0 = most similar candidate)")
    mine.add_argument("--range-max", type=int, default=50, help="consider ranks below this (default 50)")
    mine.add_argument("--margin", type=float, default=None, help="a negative scores at most the anchor's lowest "
                      "positive score less this (absolute), or less this × |that score| (relative)")
    mine.add_argument("--margin-strategy", choices=["absolute", "relative"], default="absolute")
    mine.add_argument("--max-score", type=float, default=None,
                      help="a negative's cosine with the anchor is at most this")
    mine.add_argument("--chunk-size", type=int, default=8192, help="sentences encoded and searched at a time")
    mine.add_argument("--batch-size", type=int, default=128)
    mine.add_argument("--device", default=None, help="cuda when available, else cpu")
    mine.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)


