"""How a task instruction is written before a query: `instruction_format` with `{instruction}`, the text
following it (E5-mistral's `Instruct: {task}\nQuery: {text}` by default). One place, read by the
mixture's datasets (training), `sentemb evaluate --mteb` and the export's prompts alike, so a query is
written the same way in all three."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import SentEmbUserError

E5_FORMAT = "Instruct: {instruction}\nQuery: "


def instruction_prefix(instruction: str, instruction_format: str = E5_FORMAT,
                       option: str = "instruction_format") -> str:
    """The text put before a query: `instruction_format` filled with `instruction`; '' for no instruction."""
    if not instruction:
        return ""
    if "{instruction}" not in instruction_format:
        raise SentEmbUserError(f"{option} {instruction_format!r}: it must contain {{instruction}} (the text follows "
                               f"it), e.g. {E5_FORMAT!r}")
    return instruction_format.replace("{instruction}", instruction)


def mixture_prompts(datasets: Mapping[str, Any] | None, instruction_format: str = E5_FORMAT) -> dict[str, str] | None:
    """name -> the text before that dataset's queries, for the datasets of `data.datasets` with an
    instruction: what `sentemb fit` gives the method as `prompts` (the export's and MTEB's); None without."""
    prompts = {str(name): instruction_prefix(entry["instruction"], instruction_format, "data.instruction_format")
               for name, entry in (datasets or {}).items() if isinstance(entry, Mapping) and entry.get("instruction")}
    return prompts or None
