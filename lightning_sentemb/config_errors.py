"""One line for a config that jsonargparse rejects, in place of its nested report and usage dump.

jsonargparse explains a rejected value as a tree (a Union's subtypes, each with its own error, the
given value repeated). What the user needs is the key, what was wrong, and what would be right:

    unknown key `trainer.max_step` (in experiments/x.yaml); did you mean `trainer.max_steps`?
    model.init_args.temprature: SimCSE has no such argument; did you mean `temperature`?
    model.init_args.mlp: 'nonee' is not allowed; choose one of none, train, always
    model.init_args.temperature: expected a float, got 'hot'

`describe_parse_error` reads jsonargparse's message (its wording in jsonargparse 4.3x–4.5x) and
falls back to the message's innermost lines, joined, when it recognises none of these forms.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import inspect
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

from .user_code import missing_module_error

__all__ = ["config_files_in", "describe_parse_error"]

NOISE = (
    "Does not validate against any of the Union subtypes",
    "Subtypes:",
    "Errors:",
    "Given value type:",
    "Given value:",
    "- Expected a <class 'NoneType'>",
    "Expected a path but",
    "Problem with given class_path",
)


def config_files_in(args: Sequence[str]) -> list[str]:
    """The `-c` / `--config` files of a command line, in order."""
    files = []
    for i, arg in enumerate(args):
        if arg in ("-c", "--config") and i + 1 < len(args):
            files.append(args[i + 1])
        elif arg.startswith("--config="):
            files.append(arg.removeprefix("--config="))
    return files


def describe_parse_error(message: str, keys: Iterable[str], config_files: Sequence[str] = ()) -> str:
    """One line for jsonargparse's `message`; `keys` are the options the (sub)command accepts (for
    suggestions), `config_files` the `-c` files, to say which one holds an unknown key."""
    unknown = re.search(r"does not accept option '([^']+)'|Option '([^']+)' is not accepted before"
                        r"|^unrecognized arguments: --(\S+)", message)
    if unknown and "Parser key" not in message:
        key = next(group for group in unknown.groups() if group).split("=")[0]
        where = next((f"in {file}" for file in config_files if _yaml_has_key(file, key)), "on the command line")
        return f"unknown key `{key}` ({where}){_suggestion(key, keys)}"
    outer = re.match(r'Parser key "([^"]+)"', message)
    if outer is None:
        return _innermost(message)
    key = outer.group(1)
    no_module = re.search(r"No module named '([\w.]+)'", message)
    if no_module:
        return str(missing_module_error(no_module.group(1), f"{key}.class_path"))
    class_path = _class_path(message)
    inner = re.findall(r'Parser key "([^"]+)":', message[outer.end():])  # the last is the rejected argument
    if class_path and inner:
        key = f"{key}.init_args.{inner[-1]}"
    unknown_argument = re.search(r"Option '([^']+)' is not accepted", message)
    if unknown_argument and class_path:
        name = unknown_argument.group(1)
        return (f"{key}.init_args.{name}: {class_path.rpartition('.')[2]} has no such argument"
                f"{_suggestion(name, accepted_arguments(class_path))}")
    missing_class = re.search(r"module '[\w.]+' has no attribute '(\w+)'|Expected a dot import path string: (\S+)",
                              message)
    if missing_class:
        name = missing_class.group(1) or missing_class.group(2)
        return f"{key}: no class named {name!r}{_suggestion(name, _sibling_classes(message))}"
    given = _given_value(message)
    choices = [value for found in re.findall(r"Expected a typing\.Literal\[(.*?)\]", message)
               for value in ast.literal_eval(f"[{found}]")]
    if choices:
        allowed = ", ".join(dict.fromkeys(str(choice) for choice in choices))
        return f"{key}: {given!r} is not allowed; choose one of {allowed}"
    expected = re.search(r"Expected a <class '(\w+)'>\. Got value: (.*)", message)
    if expected:
        return f"{key}: expected {_article(expected.group(1))}, got {expected.group(2).strip()!r}"
    return f"{key}: {_innermost(message[outer.end():])}"


def accepted_arguments(class_path: str) -> list[str]:
    """The constructor arguments of `class_path` as the CLI resolves them (`**kwargs` followed into
    the base classes), or [] when the class cannot be imported."""
    from jsonargparse import ArgumentParser

    try:
        module, _, name = class_path.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(cls, fail_untyped=False)
    except (ImportError, AttributeError, ValueError):
        return []
    return [action.dest for action in parser._actions if action.dest not in ("help", "config")]


def _suggestion(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean `{close[0]}`?" if close else ""


def _yaml_has_key(file: str, dotted: str) -> bool:
    try:
        node: Any = yaml.safe_load(Path(file).read_text())
    except (OSError, yaml.YAMLError):
        return False
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _class_path(message: str) -> str | None:
    found = re.search(r"class_path '([\w.]+)'|'class_path': '([\w.]+)'|class_path='([\w.]+)'", message)
    return next((group for group in found.groups() if group), None) if found else None


def _sibling_classes(message: str) -> list[str]:
    """Classes beside the one asked for (`module 'lightning_sentemb.methods' has no attribute X`),
    else the methods."""
    module = re.search(r"module '([\w.]+)' has no attribute", message)
    try:
        found = importlib.import_module(module.group(1) if module else "lightning_sentemb.methods")
    except ImportError:
        return []
    return [name for name, value in vars(found).items() if inspect.isclass(value)]


def _given_value(message: str) -> str:
    found = re.search(r"Got value: (.*)|Given value: (.*)", message)
    return next(group for group in found.groups() if group).strip() if found else "the value"


def _article(type_name: str) -> str:
    return f"{'an' if type_name[0] in 'aeiou' else 'a'} {type_name}"


def _innermost(message: str) -> str:
    """The lines of `message` that say something, without jsonargparse's scaffolding, joined."""
    lines = [line.strip().removeprefix("- ").strip() for line in message.splitlines()]
    kept = [line for line in lines if line and not line.startswith(NOISE)]
    return "; ".join(dict.fromkeys(kept)) or " ".join(message.split())
