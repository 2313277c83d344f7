import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import importlib.util  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

try:
    from hypothesis import settings
except ImportError:  # an environment without the test extra's hypothesis has no property tests to run
    settings = None
if settings is not None:
    # .ci/run sets HYPOTHESIS_PROFILE=ci: the property tests draw the same examples every run there, so a landing
    # cannot fail on a counterexample drawn for the first time; `make test` elsewhere keeps drawing new ones.
    settings.register_profile("ci", derandomize=True)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

REPO = Path(__file__).resolve().parents[1]
# Test modules import the few helpers they share (tiny_run) from tests/, which is no package (--import-mode=importlib).
sys.path.insert(0, str(REPO / "tests"))


def load_example(name: str):
    """A script of examples/ as a module (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def text_example(tmp_path_factory):
    """examples/text_reverse.py's model, tokenizer, parquet files and reward, built small once per session:
    {"model", "train", "val", "reward"} -> Path, and "module" -> the example module."""
    example = load_example("text_reverse")
    paths = example.build(tmp_path_factory.mktemp("text_example"), num_train=256, num_val=16)
    return {**paths, "module": example}


@pytest.fixture(scope="session")
def tiny_smollm(tmp_path_factory):
    """A tiny random Llama of SmolLM2's architecture written as GGUF (tests/tiny_gguf.py) and imported with
    `dppo import-gguf`, once per session: {"gguf": the file, "model": the transformers directory} -> Path."""
    from tiny_gguf import write_tiny_smollm_gguf

    from dppo.cli import main

    root = tmp_path_factory.mktemp("tiny_smollm")
    gguf = write_tiny_smollm_gguf(root / "tiny-smollm2.Q4_1.gguf")
    assert main(["import-gguf", str(gguf), str(root / "model")]) == 0
    return {"gguf": gguf, "model": root / "model"}


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
