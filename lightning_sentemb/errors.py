"""Errors that are the user's to fix: `sentemb` prints their message as one line (no traceback;
`SENTEMB_DEBUG=1` shows it) and exits 2. Tracebacks stay for bugs.

The message names the file or option at fault and how to fix it.
"""

from __future__ import annotations

__all__ = ["SentEmbUserError"]


class SentEmbUserError(Exception):
    """Bad input or a run that cannot do what was asked; the message is the whole story."""
