"""MkDocs hook: the reference pages, generated from the code at every build, so they cannot drift.

- reference/config.md from the `Config` dataclass tree (kvfabric/config.py): every key with its type, default,
  allowed values, environment variable and description. The description is the comment on the key's line in
  config.py (and the comment lines right below it): config.py is the one place a key is documented.
- reference/cli.md from the click command tree (kvfabric/apps/cli.py): each command's `--help`.
- reference/metrics.md from `kvfabric.observe.metrics.METRICS`: every metric's name, type, labels and help.

The same functions serve tests/test_docs.py (a key without a description fails there).
"""
from __future__ import annotations

import ast
import dataclasses
import io
import tokenize
import typing
from typing import Any

GENERATED = {"reference/config.md": "config", "reference/cli.md": "cli", "reference/metrics.md": "metrics"}


# ---- configuration ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class ConfigKey:
    key: str  # dotted: "disk.capacity"
    type: str  # as written in the source
    default: str
    allowed: str
    env: str
    description: str


def field_comments(source: str) -> dict[tuple[str, str], str]:
    """(class name, field name) -> the comment on the field's line plus the comment-only lines right after it."""
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.split("\n")
    out: dict[tuple[str, str], str] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for statement in node.body:
            if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
                continue
            parts = [comments[statement.lineno]] if statement.lineno in comments else []
            line = statement.end_lineno + 1
            while line in comments and lines[line - 1].strip().startswith("#"):
                parts.append(comments[line])
                line += 1
            out[(node.name, statement.target.id)] = " ".join(parts)
    return out


def _annotations(source: str) -> dict[tuple[str, str], str]:
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            for statement in node.body:
                if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                    out[(node.name, statement.target.id)] = ast.unparse(statement.annotation)
    return out


def _bytes(value: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value and value % size == 0:
            return f"{value // size} {unit}"
    return str(value)


def _default(field: dataclasses.Field, hint: Any) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = field.default_factory()  # type: ignore[misc]
    else:
        return "(required)"
    if typing.get_origin(hint) is typing.Annotated and isinstance(value, int):
        return _bytes(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(map(str, value)) + "]"
    return '""' if value == "" else str(value)


def _allowed(hint: Any) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return ", ".join(str(v) for v in typing.get_args(hint))
    if typing.get_origin(hint) is typing.Annotated:
        return "a byte size: 4GiB, 512MB, or an int" + (" (0 allowed)" if "0" in str(typing.get_args(hint)[1:]) else "")
    return ""


def config_keys(root: type, source: str, prefix: str = "", env_prefix: str = "KVFABRIC_") -> list[ConfigKey]:
    """Every key of the dataclass tree under `root` (sections first by their order in `root`)."""
    comments, annotations = field_comments(source), _annotations(source)
    hints = typing.get_type_hints(root, include_extras=True)
    keys: list[ConfigKey] = []
    for field in dataclasses.fields(root):
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            keys += config_keys(hint, source, f"{prefix}{field.name}.", f"{env_prefix}{field.name.upper()}__")
            continue
        keys.append(ConfigKey(f"{prefix}{field.name}", annotations.get((root.__name__, field.name), str(hint)),
                              _default(field, hint), _allowed(hint), f"{env_prefix}{field.name.upper()}",
                              comments.get((root.__name__, field.name), "")))
    return keys


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def config_page(root: type | None = None, source: str | None = None) -> str:
    if root is None or source is None:
        import inspect

        import kvfabric.config as module
        root, source = module.Config, inspect.getsource(module)
    keys = sorted(config_keys(root, source), key=lambda k: "." in k.key)  # top-level keys first, then sections
    out = ["# Configuration reference", "",
           "Generated from `kvfabric/config.py` at every docs build (the comment on a key's line is its description).",
           "A YAML file (`$KVFABRIC_CONFIG` or `Config.load(path)`) holds these keys, nested by section; each has an "
           "environment variable, which wins over the file. Lists in variables are comma-separated "
           "(`KVFABRIC_TIERS=cpu,disk`). An unknown key or a value outside its choices is a one-line error.", ""]
    section = None
    for key in keys:
        name = key.key.rsplit(".", 1)[0] if "." in key.key else ""
        if name != section:
            section = name
            out += ["", f"## `{section}`" if section else "## Top level", "",
                    "| key | type | default | allowed | environment | description |", "|---|---|---|---|---|---|"]
        out.append(f"| `{key.key}` | `{_cell(key.type)}` | `{_cell(key.default)}` | {_cell(key.allowed)} | "
                   f"`{key.env}` | {_cell(key.description)} |")
    return "\n".join(out) + "\n"


# ---- command line ----------------------------------------------------------------------------------------------
def cli_commands(group: Any = None, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], str]]:
    """(command path, its --help text) for every command under `group` (default: kvfabric's main group)."""
    import click
    from click.testing import CliRunner

    from kvfabric.apps.cli import main

    group = main if group is None else group
    out = []
    runner = CliRunner()
    for name in sorted(group.commands):
        command = group.commands[name]
        result = runner.invoke(main, [*path, name, "--help"], prog_name="kvfabric", catch_exceptions=True)
        out.append(((*path, name), result.output.strip()))
        if isinstance(command, click.Group):
            out += cli_commands(command, (*path, name))
    return out


def cli_page() -> str:
    out = ["# Command reference", "", "Generated from the `kvfabric` command tree (`kvfabric/apps/cli.py`) at every docs "
           "build: each command's `--help`.", ""]
    for path, text in cli_commands():
        out += [f"## `kvfabric {' '.join(path)}`", "", "```text", text, "```", ""]
    return "\n".join(out)


# ---- metrics ---------------------------------------------------------------------------------------------------
def metrics_page() -> str:
    from kvfabric.observe.metrics import METRICS

    out = ["# Metrics reference", "", "Generated from `kvfabric.observe.metrics.METRICS`, the one table every /metrics "
           "endpoint (engine, `kvfabric server`, vLLM connector) is built from.", "",
           "| name | type | labels | meaning |", "|---|---|---|---|"]
    for name, spec in METRICS.items():
        out.append(f"| `{name}` | {spec.kind} | {', '.join(spec.labels)} | {_cell(spec.help)} |")
    return "\n".join(out) + "\n"


PAGES = {"config": config_page, "cli": cli_page, "metrics": metrics_page}


def on_files(files: Any, config: Any) -> Any:  # MkDocs hook
    from mkdocs.structure.files import File

    for uri, kind in GENERATED.items():
        existing = files.get_file_from_path(uri)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, uri, content=PAGES[kind]()))
    return files
