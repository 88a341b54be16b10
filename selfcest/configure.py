"""Typed configuration: declaring settings, building them from Hydra, validating, help.

Every selfcest setting is a field of a dataclass, declared with `setting` so its help text
lives where it is declared (``selfcest-train --help`` prints it, `describe`). A config is
checked in one way: each dataclass's ``check()`` validates its own fields (raising
`ConfigError` whose message starts with the field name) and is run on construction; `build`
(from a composed Hydra config) and `validate` (on a tree of configs built or changed in
Python) run every ``check()`` and prefix the path where the error was found, so an error in
``warm_start.budget`` reads ``warm_start.budget.node_context ...``, never another section's
name.

This module is a leaf: it knows dataclasses, OmegaConf and Hydra, and nothing of selfcest.
It imports Hydra and OmegaConf only where a Hydra config is composed or read, so that the
library itself runs where they are not installed (the GPU check's bare machine).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key and the fix."""


class RunError(RuntimeError):
    """A run that cannot go on (a checkpoint that cannot be written, rewards that all fail,
    an update that keeps diverging, an output folder in use); the message names the cause
    and what was kept."""


class Choice(str, enum.Enum):
    """A setting's choices: members are their value as a string (``str()``, f-strings,
    JSON and comparisons with plain strings all see ``"token"``, not ``Protocol.token``)."""

    def __str__(self) -> str:
        return self.value


def setting(default: Any = dataclasses.MISSING, *, help: str,
            factory: Callable[[], Any] | None = None):
    """A dataclass field with its help text (``factory`` for mutable defaults)."""
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def require(condition: bool, key: str, message: str) -> None:
    """Raise ``ConfigError("<key> <message>")`` unless ``condition``."""
    if not condition:
        raise ConfigError(f"{key}{'' if message.startswith('=') else ' '}{message}")


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ----------------------------------------------------------------------------- validation


def validate(config: Any, path: str = "") -> None:
    """Run ``check()`` of ``config`` and of every dataclass nested in it (children first), with
    errors prefixed by the path they were found at. A choice given as a string (a config set
    in Python) is turned into its enum member first, or refused with the list of choices."""
    if dataclasses.is_dataclass(config):
        _coerce_sections(config, path)
    for name, value in _children(config):
        validate(value, _join(path, name))
    if dataclasses.is_dataclass(config):
        _coerce_choices(config, path)
    check = getattr(config, "check", None)
    if check is not None:
        with _at(path):
            check()


def _coerce_sections(config: Any, path: str) -> None:
    """A section given as a mapping (``config.warm_start.tasks = {"name": ...}``) is built
    into its dataclass, as Hydra would build it."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        kind, value = _dataclass_of(hints[f.name]), getattr(config, f.name)
        if kind is not None and isinstance(value, Mapping):
            setattr(config, f.name, _build(kind, value, _join(path, f.name)))


def _coerce_choices(config: Any, path: str) -> None:
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        kind = _enum_of(hints[f.name])
        value = getattr(config, f.name)
        if kind is not None and value is not None and not isinstance(value, kind):
            setattr(config, f.name, _choice(kind, value, _join(path, f.name)))


def _choice(kind: type, value: Any, key: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(member.value for member in kind)
        raise ConfigError(f"{key} must be one of {choices}; got {value!r}") from None


def _children(config: Any):
    if not dataclasses.is_dataclass(config):
        return
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            yield f.name, value
        elif isinstance(value, list):
            yield from ((f"{f.name}[{i}]", v) for i, v in enumerate(value)
                        if dataclasses.is_dataclass(v))
        elif isinstance(value, dict):
            yield from ((f"{f.name}.{k}", v) for k, v in value.items()
                        if dataclasses.is_dataclass(v))


class _at:
    """Re-raise a ValueError or TypeError from inside as a ConfigError prefixed by ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        if error is None or not isinstance(error, (ValueError, TypeError)):
            return False
        message = str(error)
        if isinstance(error, ConfigError) and getattr(error, "placed", False):
            return False
        placed = ConfigError(_join(self.path, message) if self.path else message)
        placed.placed = True
        raise placed from None


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


# ----------------------------------------------------------------------------- building


def build(kind: type, data: Any, path: str = "") -> Any:
    """``kind`` (a dataclass) from ``data`` (a composed Hydra config or a plain mapping).

    Unknown keys, missing required values and every ``check()`` of the nested dataclasses
    fail with a `ConfigError` naming the full key.
    """
    if "omegaconf" in sys.modules and isinstance(data, sys.modules["omegaconf"].DictConfig):
        from omegaconf import OmegaConf
        from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

        try:
            data = OmegaConf.to_container(data, resolve=True, throw_on_missing=True)
        except MissingMandatoryValue as error:
            key = getattr(error, "full_key", None) or "a value"
            raise ConfigError(
                f"{key} is required: set it on the command line, e.g. {key}=...") from None
        except OmegaConfBaseException as error:
            raise ConfigError(_explain(error)) from None
    return _build(kind, data, path)


def _build(kind: Any, value: Any, path: str) -> Any:
    inner = _dataclass_of(kind)
    if inner is not None and isinstance(value, Mapping):
        hints = typing.get_type_hints(inner)
        known = {f.name for f in dataclasses.fields(inner) if f.init}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"unknown key {_join(path, unknown[0])}; known keys: "
                              f"{', '.join(sorted(known))}")
        kwargs = {name: _build(hints[name], item, _join(path, name)) for name,
                  item in value.items()}
        with _at(path):
            return inner(**kwargs)
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is list and args and _dataclass_of(args[0]) and isinstance(value, list):
        return [_build(args[0], item, f"{path}[{i}]") for i, item in enumerate(value)]
    if origin is dict and len(args) == 2 and _dataclass_of(args[1]) and isinstance(value, Mapping):
        return {key: _build(args[1], item, _join(path, key)) for key, item in value.items()}
    enum_kind = _enum_of(kind)
    if enum_kind is not None and value is not None and not isinstance(value, enum_kind):
        return _choice(enum_kind, value, path)
    return value


def _dataclass_of(kind: Any) -> type | None:
    """The dataclass ``kind`` is, or is optionally (``X | None``)."""
    if dataclasses.is_dataclass(kind):
        return kind
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        inner = [t for t in typing.get_args(kind) if dataclasses.is_dataclass(t)]
        return inner[0] if inner else None
    return None


def _element_dataclass(kind: Any) -> tuple[str, type] | None:
    """For ``list[X]`` or ``dict[str, X]`` with X a dataclass: how an element's key reads in
    help (``[i]`` or ``.<name>``), and X."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is list and args and dataclasses.is_dataclass(args[0]):
        return "[i]", args[0]
    if origin is dict and len(args) == 2 and dataclasses.is_dataclass(args[1]):
        return ".<name>", args[1]
    return None


def _enum_of(kind: Any) -> type | None:
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return kind
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        inner = [t for t in typing.get_args(kind) if isinstance(t, type)
                 and issubclass(t, enum.Enum)]
        return inner[0] if inner else None
    return None


def _explain(error: Exception) -> str:
    key = getattr(error, "full_key", None)
    text = str(error).splitlines()[0]
    return f"{key}: {text}" if key else text


# ----------------------------------------------------------------------------- help


def describe(kind: type, path: str = "") -> list[str]:
    """One line per setting of ``kind`` and its nested dataclasses: key, type, default, help."""
    lines = []
    hints = typing.get_type_hints(kind)
    for f in dataclasses.fields(kind):
        key = _join(path, f.name)
        nested = _dataclass_of(hints[f.name])
        if nested is not None:
            optional = " (null by default; set the section to use it)" if f.default is None else ""
            lines.append(f"{key}: {f.metadata.get('help', '')}{optional}")
            lines += describe(nested, key)
            continue
        element = _element_dataclass(hints[f.name])
        if element is not None:  # a list or a mapping of sections
            lines.append(f"{key} ({_type_name(hints[f.name])}): {f.metadata.get('help', '')}")
            lines += describe(element[1], key + element[0])
            continue
        default = _default(f)
        lines.append(f"{key} ({_type_name(hints[f.name])}, default {default}): "
                     f"{f.metadata.get('help', '')}")
    return lines


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    return repr(value.value if isinstance(value, enum.Enum) else value)


def _type_name(kind: Any) -> str:
    enum_kind = _enum_of(kind)
    if enum_kind is not None:
        return " | ".join(member.value for member in enum_kind)
    return getattr(kind, "__name__", None) or str(kind).replace("typing.", "")


# ----------------------------------------------------------------------------- Hydra


def compose(config_name: str, overrides: list[str], kind: type) -> Any:
    """The ``kind`` config Hydra composes from `CONFIG_DIR`'s ``config_name`` and
    ``overrides`` (the schemas must be registered first). Works inside a running Hydra app
    too (a sweep composing its runs), whose Hydra instance is set aside meanwhile."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    outer = GlobalHydra.instance().hydra if GlobalHydra.instance().is_initialized() else None
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
            return build(kind, hydra_compose(config_name, overrides=overrides))
    finally:
        if outer is not None:
            GlobalHydra.instance().initialize(outer)


def check_overrides(kind: type, args: Sequence[str]) -> None:
    """Refuse a command-line override whose key no setting of ``kind`` has (with the closest
    key and the section's keys) or whose value is not one of a choice's, before Hydra would
    say so over several lines. Config groups (``model=tiny``), Hydra's own keys, keys inside
    free-form mappings (``task.params.*``) and interpolated values are left to Hydra."""
    for arg in args:
        key, sep, value = arg.partition("=")
        key = key.lstrip("+~")
        if not sep or arg.startswith(
            "-") or "@" in key or "/" in key or key.split(".")[0] == "hydra":
            continue
        if "." not in key and (CONFIG_DIR / key).is_dir():
            continue
        _check_key(kind, key, value)


def _check_key(kind: type, key: str, value: str) -> None:
    section, path, parts = kind, "", key.split(".")
    for depth, part in enumerate(parts, 1):
        fields = {f.name: f for f in dataclasses.fields(section)}
        if part not in fields:
            close = difflib.get_close_matches(part, fields, n=1)
            hint = f" (did you mean {_join(path, close[0])}?)" if close else ""
            raise ConfigError(f"unknown key {_join(path, part)}{hint}; the keys of "
                              f"{path or 'the config'}: {', '.join(sorted(fields))}")
        path = _join(path, part)
        hint = typing.get_type_hints(section)[part]
        section = _dataclass_of(hint)
        if section is None:  # a value, or a free-form mapping or list
            free_form = typing.get_origin(hint) in (dict, list) or hint is Any
            if depth < len(parts) and not free_form:
                raise ConfigError(f"{path} is a setting, not a section: {key} names nothing")
            choices = _enum_of(hint)
            if choices is not None and "${" not in value and value not in ("null", *(
                    m.value for m in choices)):
                _choice(choices, value, path)
            return


def hydra_app(config_name: str, kind: type, run: Callable[[Any], None],
              defaults: Sequence[str] = (),
              program: str = "") -> None:
    """Run ``run(config)`` as a Hydra app over `CONFIG_DIR`, ``config`` built as ``kind``.

    ``defaults`` are ``key=value`` overrides applied unless the command line sets that key
    (an experiment's own default experiment, say). ``--help`` prints every setting of
    ``kind`` (Hydra's own help: ``--hydra-help``), under the name ``program``. A configuration
    error exits with code 2 and one line on stderr, a `RunError` with code 1 and one line.
    """
    import hydra

    for default in defaults:
        key = default.split("=", 1)[0] + "="
        if not any(arg.startswith(key) for arg in sys.argv[1:]):
            sys.argv.append(default)
    if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:
        print(f"{program or Path(sys.argv[0]).name} [key=value ...]  (Hydra overrides; "
              "--hydra-help for Hydra's options)\n")
        print("\n".join(describe(kind)))
        return
    try:
        check_overrides(kind, sys.argv[1:])
    except ConfigError as error:
        print(f"selfcest: configuration error: {error}", file=sys.stderr)
        sys.exit(2)

    @hydra.main(config_path=str(CONFIG_DIR), config_name=config_name, version_base="1.3")
    def app(cfg) -> None:
        try:
            config = build(kind, cfg)
            # every app fails here on a bad key or a missing package, before compute
            validate(config)
            run(config)
        except (ConfigError, FileNotFoundError) as error:
            print(f"selfcest: configuration error: {error}", file=sys.stderr)
            sys.exit(2)
        except RunError as error:
            print(f"selfcest: stopped: {error}", file=sys.stderr)
            sys.exit(1)

    app()
