"""The benchmarks are scripts, not a package: a test module loads its script as a module through load_bench."""

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_bench(name: str):
    """benchmarks/<name>.py as the module `name`, registered in sys.modules while in use (its dataclasses look their
    module up there) and removed afterwards; a generator for a module-scoped fixture."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
