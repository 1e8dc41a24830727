"""A record's `options` are every compute option in force (benchmarks/records.py): each STRATA_
variable the product reads from its environment is there with the default the code falls back
to, or is one of the planner's typed parameters, or is named as no compute option at all. A new
variable that is none of these fails here until it is placed."""
from __future__ import annotations

import re
import sys
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
    assert "STRATA_DECODE_GRAPH" in reads and "STRATA_HOST_MAPPED" in reads
    plan = set(records.plan_env_vars())
    for var, defaults in reads.items():
        placed = var in records.COMPUTE_OPTIONS or var in plan or var in records.NOT_COMPUTE
        assert placed, f"{var} is read by strata_dist but is in no list of benchmarks/records.py"
        if var in records.COMPUTE_OPTIONS:
            # the default a record writes for an unset variable is the code's own
            assert defaults <= {records.COMPUTE_OPTIONS[var], ""}, (var, defaults)


def test_options_hold_every_compute_option_with_its_value_in_force():
    got = records.options({"STRATA_PDL": "0", "STRATA_SPLIT_HOST_GBS": "20",
                           "STRATA_PROMPT_LOANS": "0"})
    assert set(records.COMPUTE_OPTIONS) | set(records.plan_env_vars()) == set(got)
    assert got["STRATA_PDL"] == "0" and got["STRATA_SPLIT_HOST_GBS"] == "20.0"
    assert got["STRATA_PROMPT_LOANS"] == "0" and got["STRATA_REMOTE_AUTO"] == "1"
    assert got["STRATA_GDN_KERNELS"] == records.COMPUTE_OPTIONS["STRATA_GDN_KERNELS"]
