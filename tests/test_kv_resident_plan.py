"""--kv-resident in the plan (pure arithmetic): the resident part of each stage's K/V is priced
on its device, every cell in pinned host memory, and a decode token at full depth pays the host
cells' bytes over PCIe at host_gbs on top of the prediction; `auto` keeps every cell where that
fits, else each stage the most cells its own card holds; a plan without the flag is the plan it
was; --plan-only shows the split per stage."""
import json
import subprocess
import sys

import pytest

from hf_fixtures import tiny_qwen3moe, write_gguf
from test_plan_fixtures import hybrid_kinds, make_devices, make_shape
from strata_dist.plan import PlanParams, make_plan
from strata_dist.plan.errors import PlanError
from strata_dist.plan.params import KV_RESIDENT_AUTO
from strata_dist.plan.plan import Plan
from strata_dist.plan.pricing import KV_SINK_CELLS, session_bytes, session_parts

MIB = 1 << 20
CELLS = 8192


def _plan(shape, free, resident, **kw):
    return make_plan(shape, make_devices(free), cells=CELLS, split=kw.pop("split", [4]),
                     params=PlanParams(kv_resident=resident, **kw.pop("params", {})),
                     prompt_chunk=kw.pop("prompt_chunk", 256), **kw)


@pytest.mark.parametrize("kinds", [None, hybrid_kinds(8)])
def test_the_host_part_is_priced_apart_and_its_pcie_time_added(kinds):
    shape = make_shape(8, kinds=kinds)
    whole, part = _plan(shape, [4000, 4000], 0), _plan(shape, [4000, 4000], 1000)
    p = part.params
    extra_ms = 0.0
    for st, st0 in zip(part.stages, whole.stages):
        attn = [l for l in range(st.lb, st.le) if shape.layer_kind[l] == "attention"]
        kv_cell = sum(shape.kv_bytes_per_cell[l] for l in attn)
        assert st.session_bytes == st0.session_bytes - kv_cell * (CELLS - 1000)
        assert st.session_bytes == session_bytes(shape, CELLS, st.lb, st.le, 1000)
        assert st.kv_host_bytes == kv_cell * CELLS and st0.kv_host_bytes == 0
        # at full depth the host cells cross PCIe; the device reads at most its resident cells
        bw = (st.device.mem_bandwidth_gbs or p.default_bw_gbs) * 1e6
        extra_ms += (kv_cell * (CELLS - 1000) / (p.host_gbs * 1e6)
                     - kv_cell * (p.kv_fill * CELLS - 1000) / bw)
    assert part.compute_ms - whole.compute_ms == pytest.approx(extra_ms, rel=1e-9)
    assert part.predicted_ms_per_token > whole.predicted_ms_per_token
    back = Plan.from_json(part.to_json())
    assert back.to_json() == part.to_json() and back.stages[0].kv_host_bytes > 0


def test_a_plan_without_the_flag_keeps_its_json():
    plan = _plan(make_shape(8), [4000, 4000], 0)
    d = json.loads(plan.to_json())
    assert "kv_resident" not in d["params"]
    assert all("kv_host_bytes" not in st for st in d["stages"])
    assert Plan.from_json(plan.to_json()).to_json() == plan.to_json()


def _one_more_cell_does_not_fit(shape, plan, st):
    """st's card holds no further cell of K/V per session beside its stage's weights, session,
    reserves and own prompt buffers of the plan's chunk (an auto one's within the loan's cap):
    the room left after them, which its expert cache would fill, is below one more cell."""
    per_cell = plan.params.sessions * sum(
        shape.kv_bytes_per_cell[l] for l in range(st.lb, st.le)
        if shape.layer_kind[l] == "attention")
    prompt = shape.prompt_bytes(plan.prompt_chunk)
    if plan.prompt_chunk_auto:
        prompt = -(-prompt * 100 // plan.params.lend_pct)
    return st.budget_bytes - prompt < per_cell


def test_auto_keeps_every_cell_where_it_fits_and_else_the_most_that_fit():
    shape = make_shape(8)
    roomy = _plan(shape, [4000, 4000], KV_RESIDENT_AUTO)
    assert roomy.params.kv_resident == 0 and all(st.kv_host_bytes == 0 for st in roomy.stages)
    assert all(st.kv_resident == 0 for st in roomy.stages)
    free = [260, 260]
    with pytest.raises(PlanError):
        _plan(shape, free, 0)                       # every cell does not fit
    tight = _plan(shape, free, KV_RESIDENT_AUTO)
    n = tight.params.kv_resident                    # the fewest any stage keeps
    assert KV_SINK_CELLS + 256 <= n < CELLS
    assert min(st.kv_resident for st in tight.stages) == n
    with pytest.raises(PlanError):
        _plan(shape, free, n + 1)                   # one more cell everywhere does not fit
    for st in tight.stages:
        assert KV_SINK_CELLS + 256 <= st.kv_resident < CELLS
        assert st.budget_bytes >= 0
        assert _one_more_cell_does_not_fit(shape, tight, st), st
    said = ", ".join(f"stage {st.stage} ({st.device.label}) {st.kv_resident}"
                     for st in tight.stages)
    assert any(f"per stage: {said} of {CELLS}" in note for note in tight.notes), tight.notes
    with pytest.raises(PlanError, match="not even its floor"):
        _plan(shape, [150, 150], KV_RESIDENT_AUTO)


@pytest.mark.parametrize("kinds,small_mib", [(None, 260), (hybrid_kinds(8), 244)])
def test_auto_gives_each_stage_the_most_its_own_card_holds(kinds, small_mib):
    """Cards of different sizes: the smaller card's stage keeps the count with which the
    placement fits everywhere, the larger card's more (every cell where its whole context fits),
    each stage's session priced at its own count (what its rank carves, stage_fixed_bytes), and
    the plan's JSON carries each stage's count."""
    shape = make_shape(8, kinds=kinds)
    plan = _plan(shape, [small_mib, 420], KV_RESIDENT_AUTO)
    small, large = sorted(plan.stages, key=lambda st: st.device.free_bytes)
    assert 0 < small.kv_resident < CELLS
    assert large.kv_resident == 0 or large.kv_resident > small.kv_resident + 256
    for st in plan.stages:
        n = st.kv_resident
        assert st.session_bytes == session_bytes(shape, CELLS, st.lb, st.le, n)
        parts = session_parts(shape, CELLS, st.lb, st.le, n)
        assert st.kv_host_bytes == parts["kv_host"]
        assert (st.kv_host_bytes == 0) == (n == 0)
        if n:
            assert _one_more_cell_does_not_fit(shape, plan, st), st
        # its expert cache fills what its K/V left: the card is used, not overfilled
        assert st.budget_bytes >= st.own_prompt_bytes + st.cache_bytes
    # one count for every stage: the larger card's stage would hold fewer cells than it can
    uniform = _plan(shape, [small_mib, 420], plan.params.kv_resident)
    assert [st.kv_resident for st in uniform.stages] == [plan.params.kv_resident] * 2
    back = Plan.from_json(plan.to_json())
    assert [st.kv_resident for st in back.stages] == [st.kv_resident for st in plan.stages]
    assert [s.get("kv_resident", 0) for s in json.loads(plan.to_json())["stages"]] == \
        [st.kv_resident for st in plan.stages]


def test_the_floor_and_the_auto_chunk():
    shape = make_shape(8)
    with pytest.raises(PlanError, match=r"--kv-resident 259 .*floor of 260.*--prefill 256"):
        _plan(shape, [4000, 4000], 259)
    with pytest.raises(PlanError, match=r"--kv-resident 259 .*floor of 260.*--prefill auto"):
        _plan(shape, [4000, 4000], 259, prompt_chunk=None)      # the smallest auto chunk is 256
    auto_chunk = _plan(shape, [4000, 4000], 700, prompt_chunk=None)
    assert auto_chunk.prompt_chunk == 512                         # the ring holds a whole chunk
    assert session_parts(shape, CELLS, 0, 4, 100)["kv"] < session_parts(shape, CELLS, 0, 4)["kv"]


def test_plan_only_shows_resident_and_host_kv_per_stage(tmp_path):
    path = str(write_gguf(tiny_qwen3moe(3), tmp_path / "m.gguf"))
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "--model", path, "--cpu-ranks",
                           "2", "--layer-split", "2", "--max-context", "4096", "--prefill", "64",
                           "--kv-resident", "100", "--plan-only"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "K/V: of 4096 cells of each session, each stage keeps" in out
    for stage in (0, 1):
        line = next(l for l in out.splitlines() if l.strip().startswith(f"stage {stage} ("))
        assert "100 cells resident" in line
        assert "MiB on the device" in line and "MiB in host memory" in line
        assert "ms/token over PCIe at full depth" in line
