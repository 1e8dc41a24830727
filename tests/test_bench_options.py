"""A record's `options` are every compute option in force (benchmarks/records.py): the variables
of the launch's ComputeOptions and of the planner's PlanParams, each with the value the launcher's
reader gives (defaults included). Every other STRATA_ variable the product reads is named as no
compute option at all; a new one that is neither fails here until it is placed."""
from __future__ import annotations

import re
import sys

import pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import records  # noqa: E402

# os.environ.get("STRATA_X", "default") / environ.get("STRATA_X") / os.environ["STRATA_X"]
READ = re.compile(r"""environ(?:\.get\(\s*|\[\s*)["'](STRATA_[A-Z0-9_]+)["']"""
                  r"""\s*(?:,\s*["']([^"']*)["'])?""")


def reads_of_the_product() -> dict[str, set[str | None]]:
    found: dict[str, set[str | None]] = {}
    for path in sorted((ROOT / "strata_dist").rglob("*.py")):
        for var, default in READ.findall(path.read_text()):
            found.setdefault(var, set()).add(default if default != "" else "")
    return found


def test_every_variable_the_product_reads_is_placed():
    reads = reads_of_the_product()
    assert "STRATA_CACHE_DIR" in reads and "STRATA_SPLIT_COVERAGE" not in reads   # the walk works
    compute, plan = set(records.compute_env_vars()), set(records.plan_env_vars())
    for var in reads:
        placed = var in compute or var in plan or var in records.NOT_COMPUTE
        assert placed, f"{var} is read by strata_dist but is in no typed record nor NOT_COMPUTE"


def test_options_hold_every_compute_option_with_its_value_in_force():
    got = records.options({"STRATA_PDL": "0", "STRATA_SPLIT_HOST_GBS": "20",
                           "STRATA_PROMPT_LOANS": "0", "STRATA_GDN_KERNELS": ""})
    assert set(records.compute_env_vars()) | set(records.plan_env_vars()) == set(got)
    assert got["STRATA_PDL"] == "0" and got["STRATA_SPLIT_HOST_GBS"] == "20.0"
    assert got["STRATA_PROMPT_LOANS"] == "0" and got["STRATA_REMOTE_AUTO"] == "1"
    # unset: the default the launcher's reader gives, as the variable's text
    assert got["STRATA_GDN_KERNELS"] == "rows" and got["STRATA_HOST_MAPPED"] == "auto"
    assert got["STRATA_DECODE_GRAPH"] == "1" and got["STRATA_KERNEL_SHAPE"] == ""


def test_a_value_the_launcher_would_refuse_fails_the_run(capsys):
    with pytest.raises(SystemExit) as e:
        records.options({"STRATA_ROWS_MMA": "yes"})
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == "error: STRATA_ROWS_MMA='yes': expected 0 or 1"
