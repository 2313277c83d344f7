"""Fixtures of the unit tests' tiny in-process runs (their overrides are in tests/tiny_run.py)."""

import pytest
from tiny_run import small_overrides, text_overrides  # tests/tiny_run.py (tests/conftest.py puts tests/ on sys.path)

from dppo.config import load_config


@pytest.fixture
def small_cfg(tmp_path):
    """small_cfg(**{"dotted.key": value}) -> a validated DppoConfig for a tiny in-process run."""

    def make(**extra):
        return load_config(small_overrides(tmp_path, **extra))

    return make


@pytest.fixture
def small_args(tmp_path):
    """small_args(**{"dotted.key": value}) -> small_cfg's settings as `dppo train` key=value arguments."""
    return lambda **extra: small_overrides(tmp_path, **extra)


@pytest.fixture
def text_args(tmp_path, text_example):
    """text_args(**{"dotted.key": value}) -> the key=value overrides of a tiny in-process text run."""

    def make(**extra):
        return text_overrides(tmp_path, text_example, **extra)

    return make


@pytest.fixture
def text_cfg(text_args):
    """text_cfg(**{"dotted.key": value}) -> a validated DppoConfig of a tiny in-process text run."""

    def make(**extra):
        return load_config(text_args(**extra))

    return make
