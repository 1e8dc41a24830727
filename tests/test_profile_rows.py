"""benchmarks/profile_decode.py --rows N, run whole on the CuPy stand-ins
(tests/profile_rows_check.py): the batched step's table has every kernel of the one-row step and
of the batched step's replays in their columns, each the sum of its timed launches; the eager
replays launch what the captured replays do; the rows that reach step_rows (and the timed
replays) are the sessions opened, at their positions, with the ids the profile gives them. The
kernels do not run: the GPU's numbers are the next GPU session's."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from stand_ins import run_check

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import profile_decode  # noqa: E402

WARM = 2                 # profile_decode.profile_rows's warm-up steps
MAX_ROWS = 8             # the tiny model's graph takes 8 rows a replay at 128 cells
_ROW = re.compile(r"^  (\S+)\s+(-|[\d.]+ us)\s+(-|[\d.]+ us)\s+(-|[\d.]+x)$")


@pytest.fixture(scope="module", params=[("3",), ("10", "matvec_accs=16")],
                ids=["3 rows", "10 rows, matvec_accs=16"])
def report(request):
    out = run_check("profile_rows_check.py", *request.param, timeout=300)
    out["n"] = int(request.param[0])
    return out


def _us(text: str) -> float | None:
    return None if text == "-" else float(text.removesuffix(" us"))


def table(report) -> dict[str, tuple]:
    """The printed table: kernel -> (1 row, N rows, ratio) (None where "-")."""
    lines = report["printed"].splitlines()
    start = next(i for i, line in enumerate(lines)
                 if line.split()[:3] == ["kernel", "1", "row"])
    out = {}
    for line in lines[start + 1:]:
        if line.startswith("grows most"):
            return out
        m = _ROW.match(line)
        assert m, line
        ratio = None if m[4] == "-" else float(m[4].removesuffix("x"))
        out[m[1]] = (_us(m[2]), _us(m[3]), ratio)
    raise AssertionError("no summary line after the table")


def expected_column(report, steps: list[dict]) -> dict[str, float]:
    """What the column must hold for these steps' launches: each launch timed once, so each is
    the stand-ins' event time, summed per kernel as the table names it."""
    out: dict[str, float] = {}
    for step in steps:
        for name in step["kernels"]:
            family = report["families"][name]
            out[family] = out.get(family, 0.0) + report["event_ms"] * 1e3
    return out


def one_row_step(report) -> dict:
    # the first eager one-row step is kernel_times' (each launch once); the next, 10 times each
    return next(s for s in report["steps"]
                if s["rows"] == 1 and not s["every_row"] and not s["graph"])


def timed_replays(report) -> list[dict]:
    return [s for s in report["steps"] if s["every_row"] and not s["graph"]]


def test_the_table_has_every_kernel_of_each_step_in_its_column(report):
    got = table(report)
    one = expected_column(report, [one_row_step(report)])
    many = expected_column(report, timed_replays(report))
    assert len(timed_replays(report)) == -(-report["n"] // MAX_ROWS)
    assert set(got) == set(one) | set(many)
    for name, (a, b, ratio) in got.items():
        assert a == pytest.approx(one.get(name), abs=0.05) if name in one else a is None, name
        assert b == pytest.approx(many.get(name), abs=0.05) if name in many else b is None, name
        if a is not None and b is not None:
            assert ratio == pytest.approx(b / a, abs=0.005), name
        else:
            assert ratio is None, name


def test_the_timed_replays_launch_what_the_captured_replays_do(report):
    captured = {s["rows"]: s["kernels"] for s in report["steps"]
                if s["every_row"] and s["graph"]}
    for step in timed_replays(report):
        assert step["kernels"] == captured[step["rows"]]


def test_the_batched_step_runs_no_kernel_the_one_row_step_lacks(report):
    got = table(report)
    assert {name for name, (a, b, _) in got.items() if a is None} == set()
    assert got["argmax_row"][1] is None        # a batched step keeps every row's logits


def test_the_rows_reach_step_rows_as_given(report):
    n, calls = report["n"], report["calls"]
    assert len(calls) == WARM + report["n_steps"]
    splits = [MAX_ROWS] * (n // MAX_ROWS) + ([n % MAX_ROWS] if n % MAX_ROWS else [])
    for j, call in enumerate(calls):
        assert call["sessions"] == list(range(n)) and call["replays"] == splits
        assert call["positions"] == [p + j for p in report["prompt_lengths"]]
        assert call["ids"] == (report["first_ids"] if j == 0 else report["next_ids"][j - 1])
    assert len(set(report["prompt_lengths"])) == n          # each prompt its own length
    timed = report["timed"]          # the eager replays: the positions the steps left
    assert [s for t in timed for s in t["sessions"]] == list(range(n))
    assert [p for t in timed for p in t["positions"]] == [p + 1 for p in calls[-1]["positions"]]
    assert [i for t in timed for i in t["ids"]] == report["next_ids"][-1]


def test_the_step_lines_give_ms_per_step_and_per_row(report):
    n, printed = report["n"], report["printed"]
    replays = -(-n // MAX_ROWS)
    wall = re.search(rf"batched step of {n} rows \({replays} replays? of [\d+]+ rows, at most "
                     rf"{MAX_ROWS} a replay\): ([\d.]+) ms/step = ([\d.]+) ms/row", printed)
    assert wall and float(wall[2]) == pytest.approx(float(wall[1]) / n, abs=0.0015)
    gpu = re.search(r"its replays on the GPU, back to back: ([\d.]+) ms/step = ([\d.]+) ms/row",
                    printed)
    # each replay's graph launched n_steps times between two events: the replays' sums
    assert gpu and float(gpu[1]) == pytest.approx(
        replays * report["event_ms"] / report["n_steps"], abs=0.0015)


def test_the_summary_names_the_kernels_that_grow_most(report):
    line = next(l for l in report["printed"].splitlines() if l.startswith("grows most"))
    got = table(report)
    growth = sorted(((b or 0.0) - (a or 0.0), name) for name, (a, b, _) in got.items())
    top = [name for d, name in reversed(growth) if d > 0][:3]
    named = re.findall(r"(\S+) \+[\d.]+ us", line)
    assert named == top and (top or line.endswith("nothing"))


def test_one_row_leaves_the_profile_as_it_was():
    out = run_check("profile_rows_check.py", "1", timeout=300)
    assert "eager step, kernels only" in out["printed"]
    assert "batched step" not in out["printed"] and out["calls"] == [] and out["timed"] == []


def test_the_table_names_a_matvec_by_its_type_and_sums_its_builds():
    one = {"matvec_q4_K_1": 100.0, "attn_decode_128_g2": 10.0, "argmax_row": 5.0}
    many = {"matvec_q4_K_8": 150.0, "matvec_q4_K_2": 30.0, "attn_decode_128_g2": 80.0,
            "extra_kernel": 7.0}
    lines = profile_decode.rows_table(one, many, 10)
    assert lines[0].split() == ["kernel", "1", "row", "10", "rows", "10", "rows", "/", "1", "row"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:-1]}
    assert list(rows) == ["matvec_q4_K", "attn_decode_128_g2", "extra_kernel", "argmax_row"]
    assert rows["matvec_q4_K"] == ["100.0", "us", "180.0", "us", "1.80x"]
    assert rows["extra_kernel"] == ["-", "7.0", "us", "-"]
    assert rows["argmax_row"] == ["5.0", "us", "-", "-"]
    assert lines[-1] == ("grows most from 1 row to 10: matvec_q4_K +80.0 us (1.80x), "
                         "attn_decode_128_g2 +70.0 us (8.00x), extra_kernel +7.0 us (new)")


def test_the_made_up_prompts_are_the_old_ones_on_a_real_vocabulary():
    # the one-row profile's prompt before --rows (ids 10..1009), so its output is unchanged
    assert profile_decode.prompt_ids(64, 151936) == [(7919 * i) % 1000 + 10 for i in range(64)]
    assert all(10 <= t < 320 for t in profile_decode.prompt_ids(64, 320))
    with pytest.raises(ValueError, match="5 ids"):
        profile_decode.prompt_ids(4, 5)


def test_the_record_holds_what_was_printed(report):
    """The run's record (bench: profile) names the kernel shape and holds the printed figures:
    the one-row kernels, and the batched step's replays, wall and GPU time and kernels."""
    from record_check import check_record
    record, n = report["record"], report["n"]
    assert check_record(record, report["record_name"]) == []
    assert record["bench"] == "profile" and record["model"]["popularity"] == "uniform"
    arm, = record["arms"]
    assert arm["kernel_shape"] == ("matvec_accs=16" if n == 10 else "")
    rows = arm["rows"]
    assert rows["n"] == n and rows["replays"] == [MAX_ROWS] * (n // MAX_ROWS) + (
        [n % MAX_ROWS] if n % MAX_ROWS else [])
    wall = re.search(r"batched step of .*: ([\d.]+) ms/step", report["printed"])
    assert rows["step_ms"] == pytest.approx(float(wall[1]), abs=0.0015)
    got = table(report)
    for name, us in rows["kernels_us"].items():
        family = report["families"].get(name, name)
        assert got[family][1] is not None, name
    assert sum(rows["kernels_us"].values()) == pytest.approx(
        sum(b for _, b, _ in got.values() if b is not None), abs=0.5)
    assert set(arm["kernels_us"]) and all(v["name"] for v in arm["variants"])
