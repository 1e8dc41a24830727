"""The layering the design promises, read from the source: imports point only from launcher/ to
strata_dist/ to protocol/ (never back up), the planner imports no backend, and no module imports
itself through a circle, counting imports inside functions too."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"protocol": 0, "strata_dist": 1, "launcher": 2}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in LAYERS:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the repository modules it imports (a package's `from . import x` names x)."""
    graph = {}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                subs = {f"{prefix}.{a.name}" for a in node.names} & set(mods)
                deps |= subs
                if len(subs) < len(node.names) and prefix in mods:
                    deps.add(prefix)
        deps.discard(name)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_imports_point_down_and_never_in_a_circle():
    graph = _imports(_modules())
    assert len(graph) > 50 and graph["launcher.cli"]          # the walk found the code
    upward = [(m, d) for m, ds in graph.items() for d in ds
              if LAYERS[d.split(".")[0]] > LAYERS[m.split(".")[0]]]
    assert not upward, upward
    assert not _cycles(graph), _cycles(graph)
    planner = {d for m, ds in graph.items() if m.startswith("strata_dist.plan") for d in ds}
    assert not {d for d in planner if d.startswith("strata_dist.backends")}, planner


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
