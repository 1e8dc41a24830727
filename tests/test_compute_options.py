"""Every compute switch travels in one typed record (protocol/compute_options.py): read once by
the launcher (strata_dist/compute_options.py is the only module that reads the variables), refused
there when malformed (one error line naming the variable, exit 2), printed and kept in the plan,
sent in every Assign and run by each rank whatever its own environment says. The source is read
with `ast` so that GPU-only modules, which cannot run here, are held to the same rules."""
from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from protocol.codec import decode, encode
from protocol.compute_options import (ENV_VARS, REMOVED, VARIABLE_OF, ComputeOptions, env_text,
                                      options_from_env)
from protocol.messages import Assign
from strata_dist.compute_options import compute_options, installed, read_environment
from strata_dist.plan import Plan
from strata_dist.plan.params import ENV_VARS as PLAN_ENV_VARS

ROOT = Path(__file__).resolve().parents[1]
READER = ROOT / "strata_dist" / "compute_options.py"
PLAN_READER = ROOT / "strata_dist" / "plan" / "params.py"
FIELDS = {f.name for f in dataclasses.fields(ComputeOptions)}
METHODS = {"changed", "describe", "check"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from strata_dist.synth import write_synthetic
    path = tmp_path_factory.mktemp("options") / "tiny.gguf"
    write_synthetic(str(path), like="tiny", quant="q8_0", seed=0)
    return path


def _clean_env(**set_vars) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ENV_VARS and k not in PLAN_ENV_VARS and k not in REMOVED}
    return {**env, "PYTHONPATH": str(ROOT), **set_vars}


# ---- the record and its variables ----------------------------------------------------------
def test_every_field_has_one_variable_and_each_text_gives_its_value_back():
    assert set(VARIABLE_OF) == FIELDS and len(ENV_VARS) == len(FIELDS)
    assert options_from_env({}) == ComputeOptions()
    got = options_from_env({"STRATA_PDL": "0", "STRATA_HOST_MAPPED": "1", "STRATA_ATTN_HEADS": "4",
                            "STRATA_GDN_KERNELS": "0", "STRATA_KERNEL_SHAPE": "int_down=1",
                            "STRATA_IPC": " 0 ", "STRATA_ROWS_MMA": ""})        # empty: unset
    assert got == ComputeOptions(pdl=False, host_mapped=True, attn_heads=4, gdn_kernels="off",
                                 kernel_shape="int_down=1", cuda_ipc=False)
    assert got.changed() == ["kernel_shape", "pdl", "attn_heads", "host_mapped", "gdn_kernels",
                             "cuda_ipc"]
    assert options_from_env(env_text(got)) == got
    assert options_from_env(env_text(ComputeOptions())) == ComputeOptions()
    assert options_from_env({"STRATA_GDN_KERNELS": "steps", "STRATA_HOST_MAPPED": "auto"}) \
        == ComputeOptions(gdn_kernels="steps")


@pytest.mark.parametrize("var, text, says", [
    ("STRATA_PDL", "yes", "expected 0 or 1"),
    ("STRATA_DECODE_GRAPH", "2", "expected 0 or 1"),
    ("STRATA_ATTN_HEADS", "0", "number of query heads"),
    ("STRATA_ATTN_HEADS", "four", "number of query heads"),
    ("STRATA_HOST_MAPPED", "maybe", "expected auto, 1, 0"),
    ("STRATA_GDN_KERNELS", "fast", "expected rows, steps, 0"),
    ("STRATA_KERNEL_SHAPE", "bogus=1", "expected NAME=N"),
    ("STRATA_KERNEL_SHAPE", "x" * 600, "at most 512"),
])
def test_a_malformed_value_is_refused_naming_the_variable(var, text, says):
    with pytest.raises(ValueError) as e:
        read_environment({var: text})
    assert str(e.value).startswith(f"{var}={text!r}: ") and says in str(e.value)


# ---- paths deleted after they measured slower (issue 52): asking for one is refused, with why --
@pytest.mark.parametrize("var, text, says", [
    ("STRATA_FUSED_QK_NORM", "1", "0.689 against 0.692 ms"),
    ("STRATA_FUSED_QK_NORM", "attention", "0.577 against 0.574 ms"),
    ("STRATA_FUSED_QK_NORM", "0", "unset the variable"),     # the variable itself is gone
    ("STRATA_GDN_KERNELS", "staged", "82.2 against 81.0 ms"),
    ("STRATA_GDN_KERNELS", " staged ", "82.2 against 81.0 ms"),
    ("STRATA_KERNEL_SHAPE", "matvec_warp=1", "0.780 against 0.641 ms"),
    ("STRATA_KERNEL_SHAPE", "int_down=1,matvec_warp=0", "0.780 against 0.641 ms"),
    ("STRATA_KERNEL_SHAPE", "int_q8_0=1", "0.607 against 0.592 ms"),
    ("STRATA_KERNEL_SHAPE", "int_q8_0=0,int_direct=1", "0.607 against 0.592 ms"),
])
def test_a_removed_path_is_refused_naming_the_value_and_saying_it_was_removed(var, text, says):
    with pytest.raises(ValueError) as e:
        read_environment({var: text, "STRATA_PDL": "0"})
    assert str(e.value).startswith(f"{var}={text.strip()!r}: ")
    assert "removed on 2026-12-05" in str(e.value) and says in str(e.value)
    # the values kept, and an unset or empty variable, still read
    assert read_environment({"STRATA_GDN_KERNELS": "rows", "STRATA_FUSED_QK_NORM": " "}) \
        == ComputeOptions()


def test_removed_names_are_no_longer_read_as_options():
    """A removed variable sets no field and a removed value is no value of its field: REMOVED
    holds only what the table no longer takes."""
    assert "STRATA_FUSED_QK_NORM" not in ENV_VARS and "fused_qk_norm" not in FIELDS
    assert "staged" not in ENV_VARS["STRATA_GDN_KERNELS"].parse.table
    for var, gone in REMOVED.items():
        parse = ENV_VARS[var].parse if var in ENV_VARS else None
        assert parse is None or not set(gone) & set(parse.table), var


def test_assign_carries_the_record_and_the_decoder_checks_it():
    sent = ComputeOptions(pdl=False, gdn_kernels="steps", attn_heads=8, host_mapped=False)
    a = Assign(rank=0, role="stage", lb=0, le=1, first=True, last=True, device="cpu", plan={},
               compute=sent)
    got, _ = decode(encode(a))
    assert got.compute == sent and isinstance(got.compute, ComputeOptions)
    assert decode(encode(dataclasses.replace(a, compute=ComputeOptions())))[0].compute \
        == ComputeOptions()
    from protocol.messages import ProtocolError
    with pytest.raises(ProtocolError, match="attn_heads must be >= 0"):
        encode(dataclasses.replace(a, compute=ComputeOptions(attn_heads=-1)))


def test_a_tool_runs_the_record_it_read_at_its_start(monkeypatch):
    monkeypatch.setenv("STRATA_PDL", "0")
    assert compute_options().pdl is False          # nothing installed: the environment, now
    with installed(read_environment()):
        monkeypatch.setenv("STRATA_PDL", "1")      # changed while the tool runs: not seen
        assert compute_options().pdl is False
    assert compute_options().pdl is True


# ---- the launcher reads them once, refuses bad ones, prints and keeps them ------------------
@pytest.mark.parametrize("var, text", [("STRATA_GDN_KERNELS", "fast"), ("STRATA_ROWS_MMA", "on"),
                                       ("STRATA_GDN_KERNELS", "staged"),
                                       ("STRATA_FUSED_QK_NORM", "attention")])
def test_the_launcher_refuses_a_malformed_value_at_start(tiny, var, text):
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "--model", str(tiny),
                           "--cpu-ranks", "2", "--prompt-ids", "1,2", "--max-new", "1"],
                          capture_output=True, text=True, timeout=60, env=_clean_env(**{var: text}),
                          cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"error: {var}={text!r}: " + read_error(var, text)]
    assert "rank" not in done.stderr               # refused before any rank started


def read_error(var: str, text: str) -> str:
    with pytest.raises(ValueError) as e:
        read_environment({var: text})
    return str(e.value).split(": ", 1)[1]


def test_generate_refuses_a_malformed_value(tiny):
    done = subprocess.run([sys.executable, "-m", "strata_dist.tools.cli", "generate", "--model",
                           str(tiny), "--prompt-ids", "1,2", "--max-new", "1"], capture_output=True,
                          text=True, timeout=60, env=_clean_env(STRATA_ATTN_HEADS="x"), cwd=ROOT)
    assert done.returncode == 2
    assert done.stderr.strip() == "error: STRATA_ATTN_HEADS='x': expected a number of query heads"


def test_plan_only_prints_and_keeps_the_record(tiny):
    env = _clean_env(STRATA_PDL="0", STRATA_GDN_KERNELS="steps")
    argv = [sys.executable, "-m", "launcher.cli", "--model", str(tiny), "--cpu-ranks", "2",
            "--plan-only"]
    table = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert table.returncode == 0, table.stderr
    [line] = [ln for ln in table.stdout.splitlines() if ln.startswith("compute options: ")]
    assert " pdl=off " in line and " gdn_kernels=steps " in line and " decode_graph=on " in line
    assert line.endswith("(not the default: pdl, gdn_kernels)")
    js = subprocess.run(argv + ["--json"], capture_output=True, text=True, timeout=60, env=env,
                        cwd=ROOT)
    plan = Plan.from_json(js.stdout)
    assert plan.compute == ComputeOptions(pdl=False, gdn_kernels="steps")
    assert Plan.from_json(plan.to_json()) == plan


# ---- a real rank runs the record it was sent, not its environment ----------------------------
def test_a_cpu_rank_runs_the_record_of_its_assign_not_its_environment(tiny):
    from launcher.launch import Launch, LaunchConfig
    from launcher.spawn import RankSpec
    from strata_dist.plan.params import PlanParams
    sent = ComputeOptions(pdl=False, gdn_kernels="steps", host_mapped=True)
    # the ranks' own environment says otherwise, malformed where it can be: never read there
    rank_env = {"STRATA_LOG": "INFO", "STRATA_PDL": "1", "STRATA_GDN_KERNELS": "bogus",
                "STRATA_HOST_MAPPED": "maybe"}
    cfg = LaunchConfig(model=str(tiny), ranks=[RankSpec(i, "cpu", None, "1G") for i in range(2)],
                       split=[2], max_context=64, prompt_chunk=None, params=PlanParams(),
                       load_timeout_s=60, register_timeout_s=60, extra_env=rank_env, compute=sent)
    lines: list[str] = []
    launch = Launch(cfg, echo=lines.append)
    try:
        plan = launch.start()
        assert plan.compute == sent and all(a.compute == sent for a in launch._assigned)
        assert f"plan: compute options: {sent.describe()} (not the default: pdl, host_mapped, " \
               f"gdn_kernels)" in lines
        for log in launch.ranks.logs:
            text = Path(log).read_text()
            assert f"compute options {sent.describe()}" in text, text[-2000:]
    finally:
        launch.close()


# ---- read from the source: nobody else reads the variables; every attribute used exists ------
def _modules(*packages: str) -> list[Path]:
    return sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py"))


def env_reads(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """(line, variable) of each read of a variable in `names` by its literal name, or by a name
    the module binds to that literal (VAR = "STRATA_PDL"; os.environ.get(VAR)): X.get("V"),
    X.pop("V"), X["V"] (a read, not an assignment), getenv("V"), "V" in X."""
    bound = {t.id: n.value.value for n in ast.walk(tree)
             if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
             and n.value.value in names for t in n.targets if isinstance(t, ast.Name)}
    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr in ("get", "pop", "getenv", "setdefault")) \
                    or (isinstance(f, ast.Name) and f.id == "getenv"):
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and not isinstance(node.ctx, (ast.Store, ast.Del)):
            key = node.slice
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            key = node.left
        if isinstance(key, ast.Name) and key.id in bound:
            found.append((node.lineno, bound[key.id]))
        elif isinstance(key, ast.Constant) and key.value in names:
            found.append((node.lineno, key.value))
    return found


def test_only_the_readers_read_the_compute_variables():
    compute, plan = set(ENV_VARS), set(PLAN_ENV_VARS)
    bad = []
    # the benchmarks too: a driver sets the variables for what it runs, it never reads one
    for path in _modules("strata_dist", "launcher", "benchmarks"):
        tree = ast.parse(path.read_text())
        for line, var in env_reads(tree, compute | plan):
            allowed = READER if var in compute else PLAN_READER
            if path != allowed:
                bad.append(f"{path.relative_to(ROOT)}:{line} reads {var}")
    assert bad == []


def test_the_read_finder_finds_reads():
    code = ("import os\nos.environ.get('STRATA_PDL', '1')\nos.getenv('STRATA_IPC')\n"
            "env['STRATA_ROWS_MMA']\n'STRATA_FLASH_PREFILL' in os.environ\nos.environ.get('HOME')\n"
            "GRAPH = 'STRATA_DECODE_GRAPH'\nos.environ.get(GRAPH)\nos.environ['STRATA_PDL'] = '0'\n"
            "os.environ[GRAPH]\n")
    assert env_reads(ast.parse(code), set(ENV_VARS)) == [
        (2, "STRATA_PDL"), (3, "STRATA_IPC"), (4, "STRATA_ROWS_MMA"), (5, "STRATA_FLASH_PREFILL"),
        (8, "STRATA_DECODE_GRAPH"), (10, "STRATA_DECODE_GRAPH")]


def option_attributes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, attribute) of each attribute read off a compute-options record: compute_options().X,
    NAME.X where NAME = compute_options() in the same function or module, and <any>.compute.X."""
    found = []
    scopes = [n for n in ast.walk(tree)
              if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef))]

    def is_call(node) -> bool:
        return (isinstance(node, ast.Call) and (
            (isinstance(node.func, ast.Name) and node.func.id == "compute_options")
            or (isinstance(node.func, ast.Attribute) and node.func.attr == "compute_options")))
    for scope in scopes:
        held = {t.id for n in ast.walk(scope) if isinstance(n, ast.Assign) and is_call(n.value)
                for t in n.targets if isinstance(t, ast.Name)}
        for n in ast.walk(scope):
            if not isinstance(n, ast.Attribute):
                continue
            v = n.value
            if is_call(v) or (isinstance(v, ast.Name) and v.id in held) or (
                    isinstance(v, ast.Attribute) and v.attr == "compute"):
                found.append((n.lineno, n.attr))
    return sorted(set(found))


def test_every_option_attribute_used_is_a_field():
    bad, used = [], set()
    for path in _modules("strata_dist", "launcher", "benchmarks"):
        for line, attr in option_attributes(ast.parse(path.read_text())):
            used.add(attr)
            if attr not in FIELDS | METHODS:
                bad.append(f"{path.relative_to(ROOT)}:{line} reads .{attr}")
    assert bad == []
    # the walk found the GPU modules' uses (they cannot be imported here)
    assert {"flash_prefill", "pdl", "rows_mma", "host_mapped", "cuda_ipc"} <= used


def test_the_attribute_finder_finds_a_misspelt_field():
    code = ("def f():\n    options = compute_options()\n    return options.flash_prefil\n"
            "x = compute_options().pld\ny = a.compute.cuda_ipc\n")
    assert option_attributes(ast.parse(code)) == [(3, "flash_prefil"), (4, "pld"), (5, "cuda_ipc")]
