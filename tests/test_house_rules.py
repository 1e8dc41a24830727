"""Rules of the code's shape, read from the source with `ast` (GPU-only modules, which cannot be
imported here, are held to them too):

- a backend (strata_dist/backends/), or an op's launchers (strata_dist/ops/), imports no module of
  the experts' folder (strata_dist/experts/: the stores, the tiers, host pinning, the helper
  server, the adaptive cache): what a backend or an op needs of them it is passed;
- nor does it read through an expert store (`model.experts.<...>`, `getattr(model.experts, ...)`,
  `experts.outputs(...)`): it is handed values, such as the decode graph's expert-address table
  (ops/expert_addresses.py), and the models dispatch to the store;
- code outside backends/ never branches on a backend's name (`backend.name == "cupy"`): it asks
  a capability the backend declares (`backend.on_gpu`);
- no Python file is longer than MAX_LINES.

The rules between strata_dist/'s folders by role are tests/test_layering.py's (FOLDER_IMPORTS).
The fourth rule of the kind, that only the options module reads a compute switch from the
environment, is tests/test_compute_options.py's (test_only_the_readers_read_the_compute_variables).

A rule broken only in a file that another change is rewriting now is listed in its EXCEPTIONS
with the reason; an exception that no longer fails must be taken off the list (the test says so),
so the list only shrinks."""
from __future__ import annotations

import ast
from pathlib import Path

from test_layering import _imports, _modules

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600
EXPERTS_FOLDER = "strata_dist.experts"
COMPUTE_FOLDERS = ("strata_dist.backends", "strata_dist.ops")   # held to the experts rules
PACKAGES = ("strata_dist", "launcher", "protocol", "benchmarks", "tests")

NAME_CHECK_EXCEPTIONS: dict[str, str] = {}
LENGTH_EXCEPTIONS: dict[str, str] = {}


def _python_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _check_exceptions(failing: dict[str, list[str]], exceptions: dict[str, str]) -> None:
    """Every failure is in an excepted file, and every excepted file still fails."""
    unexcused = {path: what for path, what in failing.items() if path not in exceptions}
    assert not unexcused, unexcused
    healed = sorted(set(exceptions) - set(failing))
    assert not healed, f"no longer broken: take {healed} off the exceptions"


# ---- backends import no tier module -------------------------------------------------------------
def tier_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """backend or op module -> the experts' folder's modules it imports (at the top or inside a
    function)."""
    out = {}
    for module, deps in graph.items():
        tiers = sorted(d for d in deps if d == EXPERTS_FOLDER or d.startswith(EXPERTS_FOLDER + "."))
        if module.startswith(COMPUTE_FOLDERS) and tiers:
            out[module] = tiers
    return out


def test_no_backend_imports_the_expert_tiers():
    graph = _imports(_modules())
    assert any(m.startswith("strata_dist.backends.") for m in graph)
    assert tier_imports(graph) == {}


def test_the_tier_import_finder_finds_one_inside_a_function():
    graph = {"strata_dist.backends.x": {"strata_dist.experts.tiers", "strata_dist.backends.base"},
             "strata_dist.backends.z": {"strata_dist.experts.adapt", "strata_dist.experts_like"},
             "strata_dist.rank.stage": {"strata_dist.experts.tiers"},
             "strata_dist.backends.y": set(), "strata_dist.ops.moe": {"strata_dist.experts.stores"}}
    assert tier_imports(graph) == {"strata_dist.backends.x": ["strata_dist.experts.tiers"],
                                   "strata_dist.backends.z": ["strata_dist.experts.adapt"],
                                   "strata_dist.ops.moe": ["strata_dist.experts.stores"]}


# ---- backends read no expert store: they are handed values (ops/expert_addresses.py) -------
def expert_store_reads(tree: ast.AST) -> list[int]:
    """Lines that read through an expert store: an attribute chain through `.experts`
    (`model.experts`, `self.model.experts.pinned`), an attribute of a name `experts` (a store
    passed in: `experts.outputs(...)`), or getattr / hasattr on either."""
    def is_store(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "experts") or (
            isinstance(node, ast.Name) and node.id == "experts")
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (node.attr == "experts" or is_store(node.value)):
            lines.add(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr") and node.args and is_store(node.args[0])):
            lines.add(node.lineno)
    return sorted(lines)


def test_no_backend_reads_the_expert_store():
    files = sorted((ROOT / "strata_dist" / "backends").rglob("*.py"))
    assert len(files) > 10
    files += sorted((ROOT / "strata_dist" / "ops").rglob("*.py"))     # an op's launchers too
    failing = {}
    for path in files:
        lines = expert_store_reads(ast.parse(path.read_text()))
        if lines:
            failing[_relative(path)] = lines
    assert failing == {}, failing


def test_the_expert_store_finder_finds_every_form():
    code = ("a = self.model.experts.pinned\n"
            "h = getattr(self.model.experts, 'helper_addresses', None)\n"
            "y = experts.outputs(layer, x, idx)\n"
            "ok = hasattr(experts, 'cache')\n"
            "b = model.experts\n"
            "n = len(experts) + experts[0]\n"                      # a list named experts: fine
            "spec = dict(experts=table)\n"                          # a keyword: fine
            "t = self.addresses.blob_of[layer]\n")
    assert expert_store_reads(ast.parse(code)) == [1, 2, 3, 4, 5]


# ---- no branch on a backend's name outside backends/ --------------------------------------------
def backend_name_checks(tree: ast.AST) -> list[int]:
    """Lines that compare a backend's name (`<...>backend.name` ==, !=, in, not in)."""
    def is_backend_name(node) -> bool:
        if not (isinstance(node, ast.Attribute) and node.attr == "name"):
            return False
        owner = node.value
        return (isinstance(owner, ast.Name) and owner.id.endswith("backend")) or (
            isinstance(owner, ast.Attribute) and owner.attr.endswith("backend"))
    return sorted({node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare)
                   and any(is_backend_name(side) for side in [node.left, *node.comparators])})


def test_no_code_outside_backends_branches_on_a_backend_name():
    failing = {}
    for path in _python_files():
        rel = _relative(path)
        if rel.startswith(("strata_dist/backends/", "tests/")):
            continue
        lines = backend_name_checks(ast.parse(path.read_text()))
        if lines:
            failing[rel] = lines
    _check_exceptions(failing, NAME_CHECK_EXCEPTIONS)


def test_the_name_check_finder_finds_every_form():
    code = ("if backend.name == 'cupy': pass\nif self.backend.name != 'cupy': pass\n"
            "x = 'cupy' == self.arena.backend.name\nif backend.name in ('a',): pass\n"
            "if backend.on_gpu: pass\nif model.name == 'x': pass\n")
    assert backend_name_checks(ast.parse(code)) == [1, 2, 3, 4]


# ---- no file past MAX_LINES ----------------------------------------------------------------------
def test_no_python_file_is_longer_than_the_limit():
    files = _python_files()
    assert len(files) > 100
    failing = {}
    for path in files:
        n = len(path.read_text().splitlines())
        if n > MAX_LINES:
            failing[_relative(path)] = [n]
    _check_exceptions(failing, LENGTH_EXCEPTIONS)


def test_an_exception_that_heals_must_leave_the_list():
    import pytest
    with pytest.raises(AssertionError, match="take \\['b.py'\\] off"):
        _check_exceptions({"a.py": [1]}, {"a.py": "why", "b.py": "why"})
    with pytest.raises(AssertionError, match="c.py"):
        _check_exceptions({"c.py": [1]}, {})
