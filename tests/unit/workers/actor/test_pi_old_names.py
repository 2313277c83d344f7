"""pi_old's names are defined once (dppo.pi_old_names) and each registry on the ranks implements exactly them, in the
same order (the order --help and the error messages list them in)."""

from __future__ import annotations

from dppo import pi_old_names
from dppo.workers.actor.pi_old_sources import PI_OLD_SOURCES
from dppo.workers.actor.prox_method import PROX_METHODS
from dppo.workers.actor.slot_readers import SLOT_READERS


def test_each_registry_implements_exactly_the_names_the_config_accepts():
    assert tuple(PI_OLD_SOURCES) == pi_old_names.SOURCES
    assert tuple(PROX_METHODS) == pi_old_names.PROX_LOGP_METHODS
    assert tuple(SLOT_READERS) == pi_old_names.SLOT_READER_NAMES


def test_each_implementation_is_registered_under_its_own_name():
    for registry in (PI_OLD_SOURCES, PROX_METHODS, SLOT_READERS):
        assert {name: cls.name for name, cls in registry.items()} == {name: name for name in registry}


def test_the_names_module_imports_nothing():
    """The config reads these names without torch (and nothing else of dppo)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(pi_old_names))
    imported = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert [ast.unparse(n) for n in imported] == ["from __future__ import annotations"]
