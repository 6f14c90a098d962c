"""The one way to build a method ready to use, for tests, `load_method`, exports and your own code alike.

Below every method on purpose (it imports none): `loading`, which the methods' guide uses, calls it.
"""

from __future__ import annotations

from typing import Any, TypeVar

from lightning.pytorch import LightningModule

Method = TypeVar("Method", bound=LightningModule)


def build_method(cls: type[Method], *args: Any, **kwargs: Any) -> Method:
    """`cls(*args, **kwargs)`, which builds everything but the backbone's weights (a skeleton on the meta
    device), then `configure_model`, which loads them (on the CPU outside a trainer; under one, Lightning
    calls it on each rank's device, as `load_from_checkpoint` does): a method ready to `encode`, train or
    export (`methods.building`)."""
    method = cls(*args, **kwargs)
    method.configure_model()
    return method
