"""A component receives its own config section or a settings object the driver built, not the whole config: outside
dppo/launch/ and dppo/trainer/ (start-up and the driver), no module reads cfg.<section> of the root config, but for
the few listed here with the reason each still does. The measurement is issue 43's: an attribute access
cfg.<section> (or self.cfg.<section>) for a section of DppoConfig."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from dppo.config import DppoConfig

DPPO = Path(__file__).resolve().parents[3] / "dppo"
SECTIONS = {f.name for f in dataclasses.fields(DppoConfig)}
DRIVER = ("launch/", "trainer/")

# Modules outside the driver that still receive the root config, and why. Each must still read it (a module that
# stops leaves the list).
ROOT_CONFIG_READERS = {
    "config/pi_old.py": "choose_pi_old: the one decision made from the config's pi_old keys (the config's own)",
    "config/rules.py": "the config's rules across its own sections",
    "commands/evaluate.py": "`dppo eval`, a command verb above dppo.launch: it resolves its config as launch does",
    "commands/replay.py": "`dppo replay`, a command verb above dppo.launch: it builds the replay's config from the run's "
    "(its steps per cycle, its checkpoint interval)",
    "data/__init__.py": "make_prompt_source(cfg), called at start-up only (launch, dppo eval, a trainer built without "
    "a source): it dispatches to the sources' from_config, which take their own sections; not moved to the driver yet "
    "(its ~65 call sites in 30 test files)",
}


def _reads_root_config(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Attribute) and node.attr in SECTIONS):
            continue
        owner = node.value
        if (isinstance(owner, ast.Name) and owner.id == "cfg") or (
            isinstance(owner, ast.Attribute) and owner.attr == "cfg"
        ):
            return True
    return False


def test_outside_the_driver_only_the_listed_modules_read_the_root_config():
    readers = {
        str(path.relative_to(DPPO))
        for path in DPPO.rglob("*.py")
        if not str(path.relative_to(DPPO)).startswith(DRIVER) and _reads_root_config(path)
    }
    assert readers - set(ROOT_CONFIG_READERS) == set(), "a module outside launch/ and trainer/ reads the root config"
    assert set(ROOT_CONFIG_READERS) - readers == set(), "a listed module no longer reads it: drop it from the list"


def test_the_measurement_finds_a_section_read_of_cfg_and_of_self_cfg(tmp_path):
    probe = tmp_path / "probe.py"
    for text, expected in (
        ("def f(cfg):\n    return cfg.rollout.n\n", True),
        ("def f(self):\n    return self.cfg.trainer.seed\n", True),
        ("def f(rollout):\n    return rollout.n\n", False),  # its own section
        ("def f(cfg):\n    return cfg.use_ray\n", False),  # a property, not a section
    ):
        probe.write_text(text)
        assert _reads_root_config(probe) is expected, text
