"""Evaluators: pure functions of an `encode` callable and a data directory (no Lightning inside).

`sts`, `transfer`, `clustering` and `analysis` hold the evaluators, `suite` runs them by name,
`report` lays their results out as the papers' tables. This module itself imports nothing heavy:
`sentemb evaluate --help` and the data module's arguments read the evaluator names from it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import SentEmbUserError

EVALUATORS = ("sts", "transfer", "fewshot", "cluster", "analysis")
# the folds of the transfer cross-validations in SentEval's full mode (the papers' tables); SimCSE's
# evaluation during training takes 5 (`data.val_transfer_kfold`)
SENTEVAL_KFOLD = 10
# the `--whiten` sources fitted once per STS task (`evaluation.whitening`); any other is one fit on a corpus
WHITEN_PER_TASK = ("target", "task")


class UnknownEvaluatorError(SentEmbUserError, ValueError):
    """An evaluator name that is not one of `EVALUATORS`."""


def parse_evaluators(spec: str | Sequence[str], option: str = "--tasks") -> list[str]:
    """`"sts,transfer"` or a list → validated evaluator names, in the given order; `option` names
    where they were given, for the error."""
    names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec) if n.strip()]
    unknown = [n for n in names if n not in EVALUATORS]
    if unknown:
        raise UnknownEvaluatorError(f"{option}: unknown evaluator(s) {', '.join(unknown)}; "
                                    f"choose from {', '.join(EVALUATORS)}")
    return names
