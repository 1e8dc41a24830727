"""The planner's side of speculative decoding (strata_dist/plan/speculation.py, draft pricing).

- a window's expected yield and decode tok/s at an acceptance, against numbers written out;
- a step of R rows is priced as the planner prices one row, with each expert read once if any
  row routes to it (1 - (1 - p)^R), hidden rows R times on a link between hosts, host misses and
  a helper tier's reads likewise: checked against sums written out for a two-layer shape;
- `--plan-only --spec K` prints the prediction (table and JSON), a draft model's steps priced;
- the draft model is priced on the kind of device that carries it: a CPU rank reserves no
  resident experts, a GPU every one."""
import json
import subprocess
import sys

import numpy as np
import pytest

from strata_dist.models.shape import model_shape
from strata_dist.models import open_checked
from strata_dist.plan import Device, ModelShape, PlanParams, RoutingProfile, make_plan
from strata_dist.plan.pricing import MIB, session_bytes, weights_bytes
from strata_dist.plan.speculation import expected_yield, spec_tok_s, window_ms
from strata_dist.synth import write_synthetic


# ---- the arithmetic -----------------------------------------------------------------------------

def test_a_window_yields_the_geometric_sum_of_its_acceptances():
    assert expected_yield(0.5, 4) == pytest.approx(1 + 0.5 + 0.25 + 0.125 + 0.0625)   # 1.9375
    assert expected_yield(0.9, 4) == pytest.approx(1 + 0.9 + 0.81 + 0.729 + 0.6561)  # 4.0951
    assert expected_yield(0.7, 1) == pytest.approx(1.7)
    assert expected_yield(0.0, 4) == 1.0
    assert expected_yield(1.0, 4) == 5.0
    # 10 ms to verify, 2 ms to draft: 2.7731 tokens a window at 0.7
    assert spec_tok_s(0.7, 4, 10.0, 2.0) == pytest.approx(1000 * 2.7731 / 12)
    assert spec_tok_s(0.9, 0, 4.0) == pytest.approx(250.0)         # K = 0: one token a step
    for bad in ((1.5, 4), (-0.1, 4), (0.5, -1)):
        with pytest.raises(ValueError):
            expected_yield(*bad)


def _shape(cells_kv: int = 1024) -> ModelShape:
    """Two attention layers of 8 experts, top 2: 10 MiB dense each, 1 MiB an expert."""
    return ModelShape(arch="synthetic", n_layers=2, n_experts=8, top_k=2, hidden=64, n_head=4,
                      layer_kind=["attention"] * 2, layer_dense_bytes=[10 * MIB] * 2,
                      router_bytes=[MIB // 8] * 2, blob_bytes=[MIB] * 2,
                      kv_bytes_per_cell=[cells_kv] * 2, recurrent_bytes=[0, 0],
                      rope_bytes_per_cell=256, embed_bytes=4 * MIB, head_bytes=4 * MIB,
                      prompt_bytes_per_token=16 * 1024)


def _device(i: int, host: str = "localhost") -> Device:
    return Device(f"gpu{i}", 2000 * MIB, 1900 * MIB, 100.0, host, i, "", "cuda")


# every expert equally routed: one token reads a given one with probability 2/8 = 0.25, a window
# of 5 rows with probability 1 - 0.75^5
EVEN = RoutingProfile(np.ones((2, 8)))
READ_5 = 1 - 0.75 ** 5


def test_a_window_reads_each_held_expert_once_for_its_rows():
    shape, cells = _shape(), 64
    params = PlanParams(coverage="measured", remote_auto=False)
    plan = make_plan(shape, [_device(0)], cells=cells, profile=EVEN, params=params, split="none")
    assert len(plan.stages) == 1 and plan.stages[0].cache_slots == 16    # every expert held
    assert window_ms(plan, shape, EVEN, 1) == pytest.approx(plan.predicted_ms_per_token)
    # one stage at 100 GB/s = 1e8 bytes a millisecond: dense + head + embedding... read once,
    # K/V of half the context once, each of the 16 experts with its chance, layer_ms a layer
    once = 2 * 10 * MIB + 4 * MIB + 2 * 0.5 * cells * 1024
    assert window_ms(plan, shape, EVEN, 5) == pytest.approx(
        (once + 16 * READ_5 * MIB) / 1e8 + 2 * params.layer_ms)
    assert window_ms(plan, shape, EVEN, 1) == pytest.approx(
        (once + 16 * 0.25 * MIB) / 1e8 + 2 * params.layer_ms)


def test_a_window_misses_each_expert_once_and_hands_its_rows_on():
    shape, cells = _shape(), 64
    # nothing cached: every expert read over the host link (34 GB/s) once a step that needs it;
    # two stages on two hosts: a window's 5 hidden rows of 64 float32 cross between them
    params = PlanParams(coverage="measured", remote_auto=False, stage_cache_slots=0)
    plan = make_plan(shape, [_device(0, "a"), _device(1, "b")], cells=cells, profile=EVEN,
                     params=params, split=[1], order="as_given")
    assert [(s.lb, s.le) for s in plan.stages] == [(0, 1), (1, 2)]
    assert window_ms(plan, shape, EVEN, 1) == pytest.approx(plan.predicted_ms_per_token)
    p = params
    compute = (2 * 10 * MIB + 4 * MIB + 2 * 0.5 * cells * 1024) / 1e8 + 2 * p.layer_ms
    misses = 16 * READ_5 * (p.miss_ms + MIB / 34e6)
    hop = p.handoff_ms + p.link_ms + 5 * 64 * 4 / 1.25e6
    back = p.handoff_ms + p.link_ms               # token ids only
    assert window_ms(plan, shape, EVEN, 5) == pytest.approx(compute + misses + hop + back)


# ---- --plan-only, and the draft model's price ---------------------------------------------------

@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec-plan")
    target, draft = d / "target.gguf", d / "draft.gguf"
    write_synthetic(target, like="tiny", quant="q8_0", popularity="zipf:1.0", seed=4)
    write_synthetic(draft, like="tiny", quant="q2_k", popularity="zipf:1.0", seed=4)
    return str(target), str(draft), d


def _plan(*args, ok: bool = True):
    r = subprocess.run([sys.executable, "-m", "launcher.cli", *args, "--plan-only"],
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode == 0) == ok, r.stderr
    return r.stdout


def test_plan_only_prints_tok_s_at_three_acceptances(files):
    target, draft, _ = files
    base = ["--model", target, "--cpu-ranks", "1", "--max-context", "256", "--spec", "4"]
    table = _plan(*base)
    line = next(x for x in table.splitlines() if x.startswith("speculation"))
    assert "drafter ngram" in line and "drafting 0.000 ms" in line
    for a in ("0.5", "0.7", "0.9"):
        assert f" at {a}" in line
    got = json.loads(_plan(*base, "--json"))
    spec = got["speculation"]
    assert spec["k"] == 4 and spec["drafter_ms"] == 0
    want = 1000 * 1.9375 / spec["window_ms"]
    assert spec["tok_s"]["0.5"] == pytest.approx(want, rel=1e-3)   # window_ms is rounded
    assert spec["k0_tok_s"] == pytest.approx(1000 / got["predicted_ms_per_token"], rel=1e-3)
    with_draft = json.loads(_plan(*base, "--draft-model", draft, "--json"))["speculation"]
    assert with_draft["drafter"] == "model" and with_draft["drafter_ms"] > 0
    assert with_draft["tok_s"]["0.9"] < spec["tok_s"]["0.9"]     # drafting costs time
    assert "speculation" not in json.loads(_plan("--model", target, "--cpu-ranks", "1",
                                                 "--max-context", "256", "--json"))


def _reserves(*args) -> list[int]:
    return [s["reserve_bytes"] for s in json.loads(_plan(*args, "--json"))["stages"]]


@pytest.mark.parametrize("devices,kind", [("ranks", "cpu"), ("inventory", "cpu"),
                                          ("inventory", "cuda")])
def test_the_draft_model_is_priced_on_the_device_that_carries_it(files, devices, kind):
    target, draft, d = files
    if devices == "ranks":
        where = ["--cpu-ranks", "2", "--vram-budget", "1G"]
    else:                # two devices of an inventory (planned here, none needed)
        rig = d / f"rig-{kind}.json"
        rig.write_text(json.dumps([{"name": f"{kind}{i}", "total_mib": 8000, "free_mib": 7000,
                                    "index": i, "kind": kind} for i in range(2)]))
        where = ["--inventory", str(rig)]
    base = ["--model", target, *where, "--layer-split", "3", "--max-context", "256",
            "--spec", "4"]
    plain, priced = _reserves(*base), _reserves(*base, "--draft-model", draft)
    # what the draft takes as that kind of device loads it: dense weights and head, a session of
    # 256 cells, a 64-row catch-up chunk; a GPU copies every expert resident, a CPU rank reads
    # them where the file maps them
    shape = model_shape(open_checked(draft), kind, None)
    L = shape.n_layers
    want = (weights_bytes(shape, 0, L, True, True) + session_bytes(shape, 256, 0, L)
            + shape.prompt_bytes(64))
    if kind == "cuda":
        want += shape.n_experts * sum(shape.blob_bytes)
    assert priced[0] == plain[0]                  # not on the first stage
    assert priced[1] - plain[1] == want           # on the last, as its device loads it


def test_a_window_reads_a_helper_tiers_experts_once_too():
    """Half the experts in the stage's cache, the rest in a helper tier on another card of the
    host (too small for a stage): at one row the window is the plan's ms per token, and the tier's
    read time grows as the bytes its pairs are read for, by (1 - 0.75^5) / 0.25."""
    shape, cells = _shape(), 64
    params = PlanParams(coverage="measured", prompt_loans=False)
    whole = make_plan(shape, [_device(0)], cells=cells, profile=EVEN, params=params, split="none")
    st = whole.stages[0]
    fixed = st.weights_bytes + st.session_bytes + st.reserve_bytes + st.own_prompt_bytes
    stage_card = Device("gpu0", 4000 * MIB, fixed + 8 * MIB + MIB // 2, 100.0, "localhost", 0)
    tier_card = Device("gpu1", 4000 * MIB, 32 * MIB + 9 * MIB, 100.0, "localhost", 1)
    plan = make_plan(shape, [stage_card, tier_card], cells=cells, profile=EVEN, params=params,
                     split="none", order="as_given")
    [stage], [tier] = plan.stages, plan.live_helpers
    assert stage.device.name == "gpu0" and stage.cache_slots == 8 and len(tier.pairs) == 8
    assert tier.read_ms > 0 and tier.device.name == "gpu1"
    assert window_ms(plan, shape, EVEN, 1) == pytest.approx(plan.predicted_ms_per_token)
    once = 2 * 10 * MIB + 4 * MIB + 2 * 0.5 * cells * 1024
    assert window_ms(plan, shape, EVEN, 5) == pytest.approx(
        (once + 8 * READ_5 * MIB) / 1e8 + 2 * params.layer_ms + tier.read_ms * READ_5 / 0.25)
