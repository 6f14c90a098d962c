"""How a task instruction is written before a query: `instruction_format` with `{instruction}`, the text
following it (E5-mistral's `Instruct: {task}\nQuery: {text}` by default). One place, read by the
mixture's datasets (training), `sentemb evaluate --mteb` and the export's prompts alike, so a query is
written the same way in all three."""

from __future__ import annotations

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
