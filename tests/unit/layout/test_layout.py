"""The layout holds: imports point one way with no cycles, no import of dppo hides inside a function (except the
command line's, which wait until the work needs them), every config key is documented in docs/, and every
relative link of the README and docs/ resolves."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

from dppo.config.load import markdown_reference, yaml_reference

REPO = Path(__file__).resolve().parents[3]
DPPO = REPO / "dppo"

# Modules that import parts of dppo inside functions, and why: start-up time of the command line only.
LAZY_DPPO_IMPORTS = {
    "dppo/cli.py": "`dppo --help` and a bad key must not wait for torch and Ray",
    "dppo/build_info.py": "reports a build of dppo._C that fails to load instead of failing to import",
}


def test_the_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run(
        [str(lint), "--config", str(REPO / "pyproject.toml")], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "broken" in out.stdout and " 0 broken" in out.stdout


def _cycles(graph: grimp.ImportGraph, modules: set[str]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each one import cycle or more."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.find_modules_directly_imported_by(node) & modules:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(modules):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycles_between_modules():
    graph = grimp.build_graph("dppo")
    modules = {m for m in graph.modules if m.startswith("dppo")}
    assert _cycles(graph, modules) == []


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = grimp.ImportGraph()
    for name in ("p.a", "p.b", "p.c"):
        graph.add_module(name)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.c")
    assert _cycles(graph, set(graph.modules)) == []
    graph.add_import(importer="p.c", imported="p.a")
    assert _cycles(graph, set(graph.modules)) == [["p.a", "p.b", "p.c"]]


def _function_level_dppo_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if (
                    isinstance(node, ast.ImportFrom)
                    and (node.module or "").startswith("dppo")
                    or (isinstance(node, ast.Import) and any(a.name.startswith("dppo") for a in node.names))
                ):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_no_import_of_dppo_hides_inside_a_function():
    hidden = [
        hit
        for path in sorted(DPPO.rglob("*.py"))
        if str(path.relative_to(REPO)) not in LAZY_DPPO_IMPORTS
        for hit in _function_level_dppo_imports(path)
    ]
    assert hidden == []


def test_the_config_key_reference_is_up_to_date():
    written = (REPO / "docs" / "config_keys.md").read_text()
    assert written == markdown_reference(), "docs/config_keys.md is stale: run `make docs`"


def test_the_shipped_defaults_yaml_is_the_schema_written_out():
    """train.yaml is generated from the schema (one source per key): a key added to the schema alone fails here."""
    written = (REPO / "dppo" / "config" / "train.yaml").read_text()
    assert written == yaml_reference(), "dppo/config/train.yaml is stale: run `make docs`"


def test_every_key_of_help_is_documented_in_docs():
    from dppo.config import describe

    docs = "\n".join(p.read_text() for p in (REPO / "docs").glob("*.md"))
    missing = [key for key, _, _ in describe() if f"`{key}`" not in docs]
    assert missing == []


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors of the headings of a markdown text."""
    heads = re.findall(r"^#+ (.+)$", markdown, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize(
    "doc",
    sorted([REPO / "README.md", REPO / "tests" / "README.md", *(REPO / "docs").glob("*.md")]),
    ids=lambda p: str(p.relative_to(REPO)),
)
def test_every_relative_link_resolves(doc: Path):
    if not doc.exists():
        pytest.fail(f"{doc.relative_to(REPO)} is linked from the README but missing")
    text = doc.read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
            broken.append(target)
    assert broken == []
