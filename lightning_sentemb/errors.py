"""Errors that are the user's to fix: `sentemb` prints their message as one line (no traceback;
`SENTEMB_DEBUG=1` shows it) and exits 2. Tracebacks stay for bugs.

The message names the file or option at fault and how to fix it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SentEmbUserError", "check_choice"]


class SentEmbUserError(Exception):
    """Bad input or a run that cannot do what was asked; the message is the whole story."""


def check_choice(option: str, value: Any, choices: Any, allow_none: bool = False) -> None:
    """Refuse a value outside a `Literal`'s choices in one line naming the option: the CLI checks the
    annotation itself, a method built in Python (tests, notebooks) does not."""
    allowed = choices.__args__
    if value not in allowed and not (allow_none and value is None):
        listed = ", ".join(map(str, allowed))
        raise SentEmbUserError(f"{option} must be {'null or ' if allow_none else ''}one of {listed}, got {value!r}")
