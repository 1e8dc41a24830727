"""The layering the design promises, read from the source: imports point only from launcher/ to
strata_dist/ to protocol/ (never back up), the planner imports no backend, and no module imports
itself through a circle, counting imports inside functions too.

Inside strata_dist/ the folders follow the processes (docs/ARCHITECTURE.md): FOLDER_IMPORTS says
which folders each may import. The head talks to the ranks by messages only, so it imports nothing
of a rank, its experts or its compute; the server is the head's surface; the compute folders
(backends, ops, models, experts) never reach up into a rank, the head or the tools; the ops (one
module an op's launchers) import no backend, the backends call down into them, and the models
(written over an ops protocol) import neither the ops nor their launchers; the planner, the
kernels' sources and the file reader import none of the others. The root keeps only SHARED, the
modules several processes use."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"protocol": 0, "strata_dist": 1, "launcher": 2}

# strata_dist/'s root modules, each used by several roles (the rest live in a folder by role)
SHARED = {"checkpoints", "compute_options", "devices", "flag_values"}
_BELOW_MODELS = {"backends", "experts", "gguf_file", "kernels", "plan", "shared"}
FOLDER_IMPORTS: dict[str, set[str]] = {
    "plan": set(),                                              # pure: no I/O, no backend
    "kernels": set(),
    "gguf_file": set(),
    "shared": {"kernels"},
    "synth": {"gguf_file"},
    # the ops' launchers (one module an op) import nothing of the backends that call them
    "ops": {"gguf_file", "kernels", "plan", "shared"},
    "backends": {"gguf_file", "kernels", "ops", "plan", "shared"},
    # the experts build the MoE op's address table (ops/expert_addresses.py); a rank's stage
    # catches its Unsupported
    "experts": {"backends", "gguf_file", "kernels", "ops", "plan", "shared"},
    "models": _BELOW_MODELS,
    "sampling": _BELOW_MODELS | {"models", "ops"},       # ops/sample.py: the draw's arithmetic
    "rank": _BELOW_MODELS | {"models", "ops", "sampling"},
    "head": {"gguf_file", "plan", "sampling", "shared"},
    "server": {"gguf_file", "head", "plan", "sampling", "shared"},
    "tools": _BELOW_MODELS | {"models", "rank", "sampling", "synth"},
}


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


def folder_of(module: str) -> str | None:
    """strata_dist's folder a module lives in ("shared" for the root's modules); None outside."""
    parts = module.split(".")
    if parts[0] != "strata_dist" or len(parts) == 1:
        return None
    return "shared" if parts[1] in SHARED else parts[1]


def folder_breaches(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, import) pairs where a strata_dist folder imports one FOLDER_IMPORTS does not allow."""
    out = []
    for module, deps in graph.items():
        mine = folder_of(module)
        if mine is None:
            continue
        for dep in sorted(deps):
            theirs = folder_of(dep)
            if theirs is not None and theirs != mine and theirs not in FOLDER_IMPORTS.get(mine, set()):
                out.append((module, dep))
    return out


def test_every_strata_dist_module_has_a_folder_with_rules():
    pkg = ROOT / "strata_dist"
    root_modules = {p.stem for p in pkg.glob("*.py")} - {"__init__"}
    assert root_modules == SHARED, "a module at strata_dist/'s root belongs in a folder by role"
    folders = {p.parent.name for p in pkg.glob("*/__init__.py")}
    assert folders == set(FOLDER_IMPORTS) - {"shared"}, folders ^ (set(FOLDER_IMPORTS) - {"shared"})


def test_strata_dist_folders_import_only_what_their_role_allows():
    graph = _imports(_modules())
    assert {folder_of(m) for m in graph} >= set(FOLDER_IMPORTS)      # the walk found every folder
    assert not folder_breaches(graph), folder_breaches(graph)


def test_the_folder_rule_finds_a_breach():
    graph = {"strata_dist.head.session": {"strata_dist.rank.stage", "strata_dist.sampling.sampler",
                                          "strata_dist.checkpoints", "protocol.messages"},
             "strata_dist.backends.ops": {"strata_dist.experts.tiers", "strata_dist.kernels.abi"},
             "strata_dist.models.common": {"strata_dist.experts.stores"},
             "strata_dist.models.qwen3moe": {"strata_dist.ops.moe"},
             "strata_dist.ops.attention": {"strata_dist.backends.cupy_backend",
                                           "strata_dist.kernels.abi"},
             "strata_dist.backends.cupy_backend": {"strata_dist.ops.attention"},
             "launcher.cli": {"strata_dist.rank.stage"}}
    assert folder_breaches(graph) == [("strata_dist.head.session", "strata_dist.rank.stage"),
                                      ("strata_dist.backends.ops", "strata_dist.experts.tiers"),
                                      ("strata_dist.models.qwen3moe", "strata_dist.ops.moe"),
                                      ("strata_dist.ops.attention",
                                       "strata_dist.backends.cupy_backend")]


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
