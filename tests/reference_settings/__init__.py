"""The settings of the code behind each published seed row, read from the reference repositories, one
`Setting` a line with the file and line it was read from. `tests/test_reference_settings.py` holds every
seed-row config to them, so that an edit that drifts from the reference fails.

Rows are split by method family (one module each) so that each family's reading stays in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Setting:
    """`key` of config `experiments/<config>.yaml` must equal `value`, as `source` sets it.

    key: a dotted path into the config (`trainer.gradient_clip_val`, `model.init_args.lr`,
        `data.batch_size`); a key the config leaves out takes its default (the method's, the data
        module's or Lightning Trainer's signature).
    source: `owner/repo/path:line` of the reference file that sets the value, or that sets it by
        leaving it to its trainer's default (then the default's own file and line).
    """

    config: str
    key: str
    value: Any
    source: str


def all_settings() -> list[Setting]:
    """Every family's rows."""
    from . import baselines, seed_methods

    return [*seed_methods.SETTINGS, *baselines.SETTINGS]
