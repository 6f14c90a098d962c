"""Old module paths that exports written by earlier versions still name.

An export's `modules.json` names its sentence-transformers module by import path, and
sentence-transformers imports that path when it loads the folder. Modules that moved stay
importable at their old path through `MovedModules`, an import hook installed when `lightning_sentemb`
is imported, so no file is left at the old place. To add one: its old and new path to `MOVED`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType

# old path -> where the module is now
MOVED = {
    # PromptBERT / ConPVP exports: TemplateSentenceEncoder
    "lightning_sentemb.export_template": "lightning_sentemb.export.template",
    # DCPCSE exports: PrefixedTransformer
    "lightning_sentemb.encoders.prefix_st": "lightning_sentemb.export.prefix",
}


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old path in `MOVED` as a module holding the public names of the module at its new
    path (the same classes and functions)."""

    def find_spec(self, name: str, path: object = None, target: ModuleType | None = None) -> ModuleSpec | None:
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec: ModuleSpec) -> None:
        """Python's default module object."""

    def exec_module(self, module: ModuleType) -> None:
        moved = importlib.import_module(MOVED[module.__name__])
        module.__dict__.update({key: value for key, value in vars(moved).items() if not key.startswith("__")})


def install() -> None:
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModules())
