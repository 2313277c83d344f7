"""rollout.name -> the engine's EngineSpec.

A builtin name is looked up in dppo.config.choices.ROLLOUT_ENGINES (name -> "module:attribute" of its spec: one line
per engine, where the config also reads the names) and its module imported only then: an engine module imports its
own package (vllm, ...) inside functions, so that its spec can say the package is missing. Any other name is a class
path, package.module:Class, of a RolloutEngine subclass of the user's own (as verl's custom rollout classes): its
`spec` class attribute where it declares one, else a default spec (dppo.workers.rollout.engines.spec) whose build
calls Class.from_settings(settings, model_config, device). The attribute may also be an EngineSpec itself.
"""

from __future__ import annotations

import functools
import importlib

from dppo.config import ConfigError
from dppo.config.choices import ROLLOUT_ENGINES
from dppo.workers.rollout.engines.base import RolloutEngine
from dppo.workers.rollout.engines.spec import EngineSpec


class UnknownEngineError(ConfigError):
    """rollout.name is neither a builtin engine nor a class path (package.module:Class)."""


class EngineImportError(ConfigError, ImportError):
    """rollout.name's module does not import, or has no such attribute."""


class NotAnEngineError(ConfigError, TypeError):
    """rollout.name's class path names something that is neither a RolloutEngine subclass nor an EngineSpec."""


def builtin_engine_names() -> tuple[str, ...]:
    return tuple(ROLLOUT_ENGINES)


@functools.cache
def engine_spec(name: str) -> EngineSpec:
    """The spec of the engine rollout.name names (see the module docstring). UnknownEngineError, EngineImportError or
    NotAnEngineError, each one line naming the value."""
    path = ROLLOUT_ENGINES.get(name, name)
    module_name, colon, attribute = path.partition(":")
    if not colon or not module_name or not attribute:
        raise UnknownEngineError(
            f"rollout.name={name!r}: expected one of {', '.join(map(repr, ROLLOUT_ENGINES))}, or the class path "
            "package.module:Class of a RolloutEngine subclass of your own"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:  # ModuleNotFoundError included
        raise EngineImportError(f"rollout.name={name!r}: module {module_name!r} does not import: {err}") from err
    try:
        target = getattr(module, attribute)
    except AttributeError:
        raise EngineImportError(f"rollout.name={name!r}: module {module_name!r} has no {attribute!r}") from None
    if isinstance(target, EngineSpec):
        return target
    if isinstance(target, type) and issubclass(target, RolloutEngine):
        return target.spec or EngineSpec(name=name, build=target.from_settings)
    raise NotAnEngineError(
        f"rollout.name={name!r}: {module_name}.{attribute} is a {type(target).__name__}, expected a subclass of "
        "dppo.workers.rollout.engines.RolloutEngine (or an EngineSpec)"
    )
