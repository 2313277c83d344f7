"""Every test function of the suite asserts something: an assert statement, or a call whose name says it checks (an
assertion helper, pytest.raises / warns / fail, numpy's assert_*, torch.testing.assert_close). A test without one passes
whatever the code does (tests/README.md, "The rule"). Found by reading each tests/**/test_*.py file's syntax tree."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]

# A call whose name (after any leading underscores) starts with one of these is a check: assert_same_weights(),
# pytest.raises(), pytest.warns(), pytest.fail(), np.testing.assert_array_equal(), torch.testing.assert_close(), a
# helper check_*(), expect_*(), verify_*(), or close(actual, expected) (the oracle tests' tolerance check). Except a
# method named just close (pool.close(), engine.close()): that lets a resource go and checks nothing.
CHECKING_CALLS = ("assert", "raises", "warns", "fail", "check", "expect", "verify", "close")

# Tests that assert only through a helper whose name does not say so, and why. Empty: prefer an assert in the test.
ASSERTS_THROUGH_A_HELPER: dict[str, str] = {}


def _call_name(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return ""


def _is_check(call: ast.Call) -> bool:
    if isinstance(call.func, ast.Attribute) and call.func.attr == "close":
        return False
    return _call_name(call).lstrip("_").lower().startswith(CHECKING_CALLS)


def _checks(node: ast.AST) -> bool:
    """Whether node's subtree holds an assert statement or a checking call (its own body and what it nests)."""
    return any(
        isinstance(inner, ast.Assert) or (isinstance(inner, ast.Call) and _is_check(inner)) for inner in ast.walk(node)
    )


def _test_functions(tree: ast.Module):
    """The module's test functions: test_* at the top level and in Test* classes."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            yield node.name, node
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("test"):
                    yield f"{node.name}::{item.name}", item


def unchecked_tests(root: Path = TESTS) -> list[str]:
    """'path::name' of every test function under root whose body has no assertion and no checking call."""
    found = []
    for path in sorted(root.rglob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for name, node in _test_functions(tree):
            if not _checks(node):
                found.append(f"{path.relative_to(root.parent).as_posix()}::{name}")
    return found


def test_every_test_function_asserts_or_expects_an_exception():
    unchecked = [t for t in unchecked_tests() if t not in ASSERTS_THROUGH_A_HELPER]
    assert not unchecked, f"{len(unchecked)} test(s) assert nothing: {unchecked}"


def test_the_scan_finds_a_test_that_asserts_nothing_and_passes_one_that_does(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_sample.py").write_text(
        "import pytest\n"
        "def test_calls_only():\n    run()\n"
        "def test_asserts():\n    assert run() == 1\n"
        "def test_expects():\n    with pytest.raises(ValueError):\n        run()\n"
        "def test_a_helper():\n    assert_same_weights(a, b)\n"
        "def test_an_oracle_tolerance():\n    close(loss, v_loss, 'loss')\n"
        "def test_closes_a_pool_only():\n    pool = make()\n    pool.close()\n"
        "def test_nested_helper_never_called():\n    def inner():\n        return 1\n    inner()\n"
        "class TestGroup:\n    def test_in_a_class(self):\n        run()\n"
        "def helper():\n    run()\n"
    )
    assert unchecked_tests(tmp_path / "tests") == [
        "tests/test_sample.py::test_calls_only",
        "tests/test_sample.py::test_closes_a_pool_only",
        "tests/test_sample.py::test_nested_helper_never_called",
        "tests/test_sample.py::TestGroup::test_in_a_class",
    ]
