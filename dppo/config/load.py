"""Loading the config and describing it: the dataclass schema <- dppo/config/train.yaml <- an optional user
YAML file <- `key=value` overrides, validated field by field and across fields, so a bad setting fails with a
ConfigError naming the key and the value before any process or Ray cluster starts; and the (key, default,
doc) rows that `dppo train --help` prints."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import os
import re
import textwrap
import typing
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dppo.config.checks import ConfigError
from dppo.config.schema import DppoConfig

DEFAULTS_YAML = Path(__file__).resolve().parent / "train.yaml"


def _convert_omegaconf_error(err: OmegaConfBaseException) -> ConfigError:
    """A one-line ConfigError naming the key and value OmegaConf rejected."""
    key = getattr(err, "full_key", None)
    msg = str(err).splitlines()[0]
    if isinstance(err, KeyError):
        parent = key.rsplit(".", 1)[0] if key and "." in key else ""
        valid = ", ".join(list_keys(prefix=parent, leaves_only=False))
        return ConfigError(
            f"unknown config key {key!r}; valid keys{' under ' + repr(parent) if parent else ''}: {valid}"
        )
    if key:
        return ConfigError(f"{key}: {msg}")
    return ConfigError(msg)


# One rule for '_' in values: it never separates digits (YAML would read 1_000 as 1000 and 0.5_2 as 0.52); in a
# rollout-correction threshold it separates the bounds of "lo_hi", so there a value like 0.5_2 stays text.
_UNDERSCORED_NUMBER = re.compile(r"[-+]?[\d_]*\.?[\d_]*(?:[eE][-+]?[\d_]+)?")
LO_HI_KEYS = frozenset(
    {"algorithm.rollout_correction.rollout_is_threshold", "algorithm.rollout_correction.rollout_rs_threshold"}
)


def _underscored_number(key: str, text: str) -> str | None:
    """text quoted as a YAML string if it looks like a number written with '_' and key takes text (a lo_hi threshold,
    a path); ConfigError if key takes a number; None if text is no such number (YAML reads it as it is)."""
    if "_" not in text or not any(c.isdigit() for c in text) or not _UNDERSCORED_NUMBER.fullmatch(text):
        return None
    if key in LO_HI_KEYS or _takes_text(key):
        return f"'{text}'"
    raise ConfigError(
        f"{key}={text}: write numbers without '_' separators (e.g. {text.replace('_', '')}); '_' only "
        "separates the bounds of a 'lo_hi' rollout-correction threshold"
    )


@functools.cache
def _takes_text(key: str) -> bool:
    """Whether the schema types key as a string (an unknown key: no, the merge names it)."""
    cls: Any = DppoConfig
    *sections, name = key.split(".")
    for section in sections:
        hints = typing.get_type_hints(cls)
        if section not in hints or not dataclasses.is_dataclass(hints[section]):
            return False
        cls = hints[section]
    hint = typing.get_type_hints(cls).get(name)
    return hint is str or str in typing.get_args(hint)


def _parse_overrides(overrides: list[str]):
    """key=value strings -> an OmegaConf dotlist config; a malformed item raises ConfigError."""
    items = []
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} must look like key=value (e.g. trainer.total_steps=20)")
        key, value = item.split("=", 1)
        if key in _sections():
            raise ConfigError(f"{item!r}: {key} is a config section, not a value; set its keys ({key}.<name>=...)")
        quoted = _underscored_number(key, value.strip())
        items.append(item if quoted is None else f"{key}={quoted}")
    try:
        return OmegaConf.from_dotlist(items)
    except OmegaConfBaseException as err:
        raise _convert_omegaconf_error(err) from None


def _check_sections(file_cfg: DictConfig, where: str, prefix: str = "") -> None:
    """Every config section the file sets must be a mapping of keys (OmegaConf's merge error names neither)."""
    sections = _sections()
    for key, value in file_cfg.items_ex(resolve=False):
        dotted = f"{prefix}{key}"
        if dotted not in sections:
            continue  # a value (checked by the merge) or an unknown key (named by the merge)
        if not isinstance(value, DictConfig):
            shown = "null" if value is None else repr(value)
            raise ConfigError(
                f"{where}: {dotted}: {shown} is a value, but {dotted} is a config section; "
                f"write its keys under it (e.g. {list_keys(dotted + '.')[0]})"
            )
        _check_sections(value, where, dotted + ".")


def _load_config_file(config_file: str | os.PathLike) -> DictConfig:
    """The YAML file of overrides as a DictConfig of sections; any problem is a one-line ConfigError naming it."""
    where = f"config file {str(config_file)!r}"
    if not os.path.isfile(config_file):
        raise ConfigError(f"{where} does not exist")
    try:
        file_cfg = OmegaConf.load(config_file)
    except (yaml.YAMLError, OSError) as err:  # OSError: YAML that is a lone scalar
        raise ConfigError(f"{where}: not a YAML mapping of config sections: {' '.join(str(err).split())}") from None
    if not isinstance(file_cfg, DictConfig):
        raise ConfigError(
            f"{where}: expected a mapping of config sections (trainer:, actor:, ...) at the top level; "
            f"got a {type(file_cfg).__name__.removesuffix('Config').lower()}"
        )
    _check_sections(file_cfg, where)
    for key, text in _underscored_scalars(config_file):
        if _underscored_number(key, text) is not None:
            OmegaConf.update(file_cfg, key, text, merge=False)  # the text as written, not YAML's number
    return file_cfg


def _underscored_scalars(config_file: str | os.PathLike) -> list[tuple[str, str]]:
    """(dotted key, the value's text) of every plain scalar of the YAML file holding a '_' (its raw text: the
    value YAML makes of it may have lost the '_')."""
    with open(config_file, encoding="utf-8") as f:
        root = yaml.compose(f)
    found = []

    def walk(node, prefix: str) -> None:
        for key_node, value in getattr(node, "value", []) if isinstance(node, yaml.MappingNode) else []:
            dotted = f"{prefix}{key_node.value}"
            if isinstance(value, yaml.MappingNode):
                walk(value, dotted + ".")
            elif isinstance(value, yaml.ScalarNode) and value.style is None and "_" in value.value:
                found.append((dotted, value.value))

    walk(root, "")
    return found


def load_config(
    overrides: list[str] | tuple[str, ...] = (), config_file: str | os.PathLike | None = None
) -> DppoConfig:
    """Schema defaults <- config_file <- key=value overrides, validated; raises ConfigError. (The shipped train.yaml is
    the schema's defaults written out by yaml_reference, for reading: a test keeps it current.)"""
    file_cfg = _load_config_file(config_file) if config_file is not None else None
    override_cfg = _parse_overrides(list(overrides))
    merged = OmegaConf.structured(DppoConfig)
    if file_cfg is not None:
        try:
            merged = OmegaConf.merge(merged, file_cfg)
        except OmegaConfBaseException as err:
            raise ConfigError(f"config file {str(config_file)!r}: {_convert_omegaconf_error(err)}") from None
    try:
        return OmegaConf.to_object(OmegaConf.merge(merged, override_cfg))
    except OmegaConfBaseException as err:
        raise _convert_omegaconf_error(err) from None


def to_dict(cfg: DppoConfig) -> dict:
    """The config as plain nested dicts (for checkpoints and the trackers): what OmegaConf's to_container of the
    structured config gives, without its cost (about 15 ms a call, at every checkpoint)."""
    return dataclasses.asdict(cfg)


def to_yaml(cfg: DppoConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


# ---------------------------------------------------------------------------------------------------
# Documentation (for `dppo train --help`)
# ---------------------------------------------------------------------------------------------------


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under it in the class body (parsed once per class)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe(cls: type = DppoConfig, prefix: str = "", defaults: Any = None) -> list[tuple[str, object, str]]:
    """(dotted key, default, doc) for every leaf field: the schema's defaults and docstrings."""
    if defaults is None:
        defaults = DppoConfig()
    docs = _field_docs(cls)
    rows = []
    for f in dataclasses.fields(cls):
        value = getattr(defaults, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            rows.extend(describe(type(value), key + ".", value))
        else:
            rows.append((key, value, docs.get(f.name, "")))
    return rows


@functools.cache
def _all_keys() -> tuple[str, ...]:
    """Every leaf key (the schema does not change at run time; load_config asks on every call)."""
    return tuple(key for key, _, _ in describe())


@functools.cache
def _sections() -> frozenset[str]:
    """Every config section's dotted path (trainer, algorithm, algorithm.rollout_correction, ...)."""
    return frozenset(key.rsplit(".", 1)[0] for key in _all_keys())


def list_keys(prefix: str = "", leaves_only: bool = True) -> list[str]:
    """Config keys directly under prefix ('' for the sections); all leaves under it if leaves_only."""
    rows = _all_keys()
    if leaves_only:
        return [k for k in rows if k.startswith(prefix)]
    depth = prefix.count(".") + 1 if prefix else 0
    start = prefix + "." if prefix else ""
    return sorted({k.split(".")[depth] for k in rows if k.startswith(start)})


def markdown_reference() -> str:
    """docs/config_keys.md: every key with its default and its doc, a table per section (`make docs` writes it;
    a test keeps the file equal to this)."""
    out = [
        "# Config keys",
        "",
        "Every key of `dppo train`, with its default and what it does (the same text as `dppo train --help`;",
        "generated from the schema in dppo/config/schema.py by `make docs`).",
        "",
    ]
    section = None
    for key, default, doc in describe():
        head = key.rsplit(".", 1)[0]
        if head != section:
            section = head
            out += ["", f"## {head}", "", "| key | default | meaning |", "|---|---|---|"]
        value = "null" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
        cell = doc.replace("|", "\\|")  # a | inside a doc would end the table cell
        out.append(f"| `{key}` | `{value}` | {cell} |")
    return "\n".join(out) + "\n"


def yaml_reference() -> str:
    """dppo/config/train.yaml: every key with its default, each under its doc as a comment (`make docs` writes it; a
    test keeps the file equal to this). The schema is the one source of both files."""
    out = [
        "# The defaults of `dppo train` (the `make demo` run): every key, with what it does. Generated from the schema",
        "# (dppo/config/schema.py) by `make docs`; override any key on the command line as key=value, or pass a YAML",
        "# file of overrides with --config.",
    ]
    opened: list[str] = []
    for key, default, doc in describe():
        *sections, name = key.split(".")
        common = next((i for i, (a, b) in enumerate(zip(opened, sections)) if a != b), min(len(opened), len(sections)))
        for depth in range(common, len(sections)):
            out.append(f"{'  ' * depth}{sections[depth]}:")
        opened = sections
        indent = "  " * len(sections)
        out.extend(f"{indent}# {line}" for line in textwrap.wrap(doc, width=116 - len(indent)))
        value = yaml.safe_dump(default, default_flow_style=True, width=1000).strip().removesuffix("\n...").strip()
        out.append(f"{indent}{name}: {value}")
    return "\n".join(out) + "\n"
