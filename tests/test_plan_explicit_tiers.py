"""The operator's hand on the layout: --stage-gpus (which listed cards run stages) and
--expert-cache-device N=MiB (explicit helper tiers), in the planner and through the real CLI.

The seed rig is 2 x 12 GB + 2 x 16 GB cards (two RTX 3060, two RTX 5060 Ti); its seeds run
`--layer-split 30` with the stages on the 12 GB cards 0 and 1 and a 3500 MiB expert cache on each
16 GB card. Its model is a 48-layer hybrid (attention every 4th layer) at IQ3_S; the planner
tests take the published Qwen3-Next-80B-A3B geometry (synth `--like qwen3-next-80b-a3b`: 48
layers, 512 experts top-10, hidden 2048, expert ff 512, 16 q / 2 kv heads of 256) with IQ3_S
expert blobs (110 bytes per 256 weights)."""
import json
import subprocess
import sys
from dataclasses import replace

import pytest

from test_plan_fixtures import MIB, make_devices, make_shape, reference_score, skewed_profile
from strata_dist.plan import (HELPER_RESERVE_BYTES, Plan, PlanError, PlanParams, devices_from_json,
                              make_plan, shape_from_geometry)
from strata_dist.plan.explicit import ExplicitTier, parse_explicit_tiers

CELLS = 32768
SEED_BLOB = 3 * 2048 * 512 * 110 // 256          # one IQ3_S expert: gate, up and down of 2048 x 512
SEED_RIG = [  # what NVML reports on the seed rig (MiB)
    {"name": "RTX 3060", "total_mib": 12288, "free_mib": 11800, "mem_bandwidth_gbs": 360},
    {"name": "RTX 3060", "total_mib": 12288, "free_mib": 11800, "mem_bandwidth_gbs": 360},
    {"name": "RTX 5060 Ti", "total_mib": 16311, "free_mib": 15800, "mem_bandwidth_gbs": 448},
    {"name": "RTX 5060 Ti", "total_mib": 16311, "free_mib": 15800, "mem_bandwidth_gbs": 448},
]


def seed_shape():
    kinds = ["attention" if (l + 1) % 4 == 0 else "linear" for l in range(48)]
    # a GDN layer's state: 32 value heads of 128 x 128 f32, plus the conv window (3 of 8192 f32)
    return shape_from_geometry(n_layers=48, n_experts=512, top_k=10, hidden=2048, expert_ff=512,
                               n_head=16, n_head_kv=2, head_dim=256, vocab=151936,
                               expert_bytes_per_elem=110 / 256, arch="qwen3next", layer_kind=kinds,
                               recurrent_bytes=32 * 128 * 128 * 4 + 3 * 8192 * 4)


@pytest.fixture(scope="module")
def seed():
    return seed_shape(), devices_from_json(SEED_RIG)


def roles(plan):
    return {d.index: (plan.stage_on(d), plan.helper_on(d)) for d in plan.devices}


def test_the_seed_rig_layout_stages_on_0_and_1_helpers_on_2_and_3(seed):
    shape, devs = seed
    assert shape.blob_bytes[0] == SEED_BLOB
    # what the issue saw: left to itself, --layer-split 30 puts the stages on the 16 GB cards
    free = make_plan(shape, devs, cells=CELLS, split=[30])
    assert sorted(st.device.index for st in free.stages) == [2, 3]

    plan = make_plan(shape, devs, cells=CELLS, split=[30], stage_gpus=["0", "1"])
    r = roles(plan)
    assert [(st.device.index, st.lb, st.le) for st in plan.stages] == [(0, 0, 30), (1, 30, 48)]
    for i in (2, 3):
        st, h = r[i]
        assert st is None and h is not None and not h.skipped and h.pairs and not h.explicit
        assert h.bytes == len(h.pairs) * SEED_BLOB
        assert plan.left_bytes(h.device) == SEED_RIG[i]["free_mib"] * MIB - HELPER_RESERVE_BYTES - h.bytes
    assert "--stage-gpus 0,1: stages on 0 RTX 3060, 1 RTX 3060; helper tiers only on 2 RTX 5060 Ti, " \
           "3 RTX 5060 Ti" in plan.notes

    # the seeds' tiers: 3500 MiB each on the 16 GB cards, as the operator sized them
    sized = make_plan(shape, devs, cells=CELLS, split=[30], stage_gpus=["0", "1"],
                      helper_tiers=parse_explicit_tiers(["2=3500", "3=3500"]))
    assert [st.pairs for st in sized.stages] == [st.pairs for st in plan.stages]   # stages untouched
    for i in (2, 3):
        h = sized.helper_on(sized.devices[i])
        assert h.explicit and not h.skipped
        assert h.budget_bytes == 3500 * MIB
        assert len(h.pairs) == 3500 * MIB // SEED_BLOB            # the budget, filled with blobs
        assert h.bytes == len(h.pairs) * SEED_BLOB
    assert Plan.from_json(sized.to_json()).to_dict() == sized.to_dict()
    assert all(h["explicit"] for h in json.loads(sized.to_json())["helpers"][2:])


def test_an_explicit_tier_on_a_stage_card_comes_before_its_cache(seed):
    shape, devs = seed
    base = make_plan(shape, devs, cells=CELLS, split=[30], stage_gpus=["0", "1"])
    plan = make_plan(shape, devs, cells=CELLS, split=[30], stage_gpus=["0", "1"],
                     helper_tiers=[ExplicitTier("1", 2000 * MIB)])
    before, after = base.stages[1], plan.stages[1]
    assert (after.lb, after.le, after.weights_bytes, after.session_bytes) == \
        (before.lb, before.le, before.weights_bytes, before.session_bytes)
    assert after.budget_bytes == before.budget_bytes - 2000 * MIB - HELPER_RESERVE_BYTES
    h = plan.helper_on(plan.devices[1])
    assert h.explicit and h.budget_bytes == 2000 * MIB and h.bytes == len(h.pairs) * SEED_BLOB
    assert plan.left_bytes(plan.devices[1]) >= 0
    assert after.cache_slots < before.cache_slots


def test_explicit_tiers_stay_when_the_automatic_ones_are_off(seed):
    shape, devs = seed
    plan = make_plan(shape, devs, cells=CELLS, split=[30], stage_gpus=["0", "1"],
                     params=PlanParams(remote_auto=False),
                     helper_tiers=[ExplicitTier("3", 1000 * MIB)])
    live = {h.device.index: h for h in plan.live_helpers}
    assert list(live) == [3] and live[3].explicit
    assert "helper tiers are off" in plan.helper_on(plan.devices[2]).reason


@pytest.mark.parametrize("kw,needles", [
    (dict(helper_tiers=[ExplicitTier("2", 20000 * MIB)]),
     ["--expert-cache-device 2=20000", "asked 20000.0 MiB", "15768.0 MiB for a helper tier",
      "15800.0 MiB free"]),
    (dict(helper_tiers=[ExplicitTier("1", 10500 * MIB)]),       # the stage no longer fits
     ["stage 2 [30, 48) on 1 RTX 3060 needs", "1268.0 MiB after its explicit helper tier's 10532.0 MiB",
      "11800.0 MiB free before it"]),
    (dict(split=[20, 30]), ["--layer-split 20,30 makes 3 stages", "names 2 card(s)"]),
    (dict(stage_gpus=["0", "5"]), ["--stage-gpus 0,5", "no listed device 5", "listed: 0, 1, 2, 3"]),
    (dict(stage_gpus=["1", "1"]), ["device 1 is named twice"]),
    (dict(helper_tiers=[ExplicitTier("2", 100 * MIB), ExplicitTier("2", 200 * MIB)]),
     ["--expert-cache-device 2=200", "already has", "2=100"]),
    (dict(helper_tiers=[ExplicitTier("x", 100 * MIB)]), ["'x' is not a device index"]),
])
def test_refusals_name_both_values(seed, kw, needles):
    shape, devs = seed
    args = {"split": [30], "stage_gpus": ["0", "1"], **kw}
    with pytest.raises(PlanError) as e:
        make_plan(shape, devs, cells=CELLS, **args)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def test_an_explicit_tier_with_nothing_to_hold_is_refused_not_skipped():
    shape = make_shape(n_layers=4, n_experts=4)
    devs = make_devices([4000, 4000, 4000])
    with pytest.raises(PlanError, match=r"--expert-cache-device 2=100: the tier on 2 gpu2 would hold "
                                        r"nothing: every pair is already held"):
        make_plan(shape, devs, cells=256, stage_gpus=["0", "1"],
                  helper_tiers=[ExplicitTier("2", 100 * MIB)])


def test_hosts_sharing_an_index_are_named_host_n():
    shape = make_shape(n_layers=6, n_experts=4)
    a, b = make_devices([3000, 3000], hosts=["h1", "h2"])
    devs = [a, replace(b, index=0)]
    with pytest.raises(PlanError, match="listed on 2 hosts"):
        make_plan(shape, devs, cells=256, stage_gpus=["0"])
    plan = make_plan(shape, devs, cells=256, stage_gpus=["h2:0"])
    assert [st.device.host for st in plan.stages] == ["h2"]


@pytest.mark.parametrize("seed_", range(4))
def test_the_stage_gpus_search_is_the_best_split_over_exactly_those_cards(seed_):
    """Against the reference scorer (tests/test_plan_fixtures.py) over every split point of the
    named cards, with an explicit tier taken off one of them first."""
    shape = make_shape(n_layers=7, n_experts=24, seed=seed_)
    prof = skewed_profile(7, 24, seed_)
    devs = make_devices([600, 420, 700, 480], bw=[300, 500, 900, 400])
    params = PlanParams(remote_auto=False)
    tier = 40 * MIB
    plan = make_plan(shape, devs, cells=512, profile=prof, params=params, order="as_given",
                     stage_gpus=["3", "1"], helper_tiers=[ExplicitTier("1", tier)])
    assert [st.device.index for st in plan.stages] == [1, 3]      # planning order, not the flag's
    carved = list(devs)
    carved[1] = replace(devs[1], free_bytes=devs[1].free_bytes - tier - HELPER_RESERVE_BYTES)
    best = min(reference_score(shape, carved, prof, 512, params, (1, 3), (0, k, 7)) for k in range(1, 7))
    got = (0, plan.stages[1].lb, 7)
    assert reference_score(shape, carved, prof, 512, params, (1, 3), got) == pytest.approx(best)
    assert all(plan.stage_on(d) is None for d in (devs[0], devs[2]))
    h = plan.helper_on(devs[1])
    assert h.explicit and 0 < h.bytes <= tier and plan.left_bytes(devs[1]) >= 0


def test_one_stage_card_runs_every_layer():
    shape = make_shape(n_layers=5, n_experts=4)
    plan = make_plan(shape, make_devices([2000, 2000, 2000]), cells=256, stage_gpus=["2"])
    assert [(st.device.index, st.lb, st.le) for st in plan.stages] == [(2, 0, 5)]


# ---- the real CLI ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model48(tmp_path_factory):
    """The seeds' layer count and layout (48 layers, attention every 4th), tiny widths."""
    from strata_dist.synth import NEXT_GEOMETRIES, write_synthetic
    g = replace(NEXT_GEOMETRIES["tiny-next"], name="tiny-next-48", n_layer=48)
    path = tmp_path_factory.mktemp("explicit") / "next48.gguf"
    write_synthetic(path, like=g, quant="f32", popularity="uniform")
    return str(path)


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    path = tmp_path_factory.mktemp("rig") / "seed-rig.json"
    path.write_text(json.dumps(SEED_RIG))
    return str(path)


def launch(*args):
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True,
                          text=True, timeout=120)


def test_plan_only_shows_the_seed_layout(model48, rig):
    proc = launch("--model", model48, "--inventory", rig, "--plan-only", "--stage-gpus", "0,1",
                  "--layer-split", "30", "--expert-cache", "4", "--max-context", "32768",
                  "--expert-cache-device", "2=3500,3=3500")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line[:1].isdigit()}
    assert "stage 0" in rows["0"] and "[0, 30)" in rows["0"]
    assert "stage 1" in rows["1"] and "[30, 48)" in rows["1"]
    for i in "23":
        assert " helper (explicit) " in rows[i] and "stage" not in rows[i]
        assert f"explicit helper tier on {i} RTX 5060 Ti: 3500.0 MiB (--expert-cache-device {i}=3500)" \
            in proc.stdout
    as_json = launch("--model", model48, "--inventory", rig, "--plan-only", "--json", "--stage-gpus",
                     "0,1", "--layer-split", "30", "--expert-cache", "4",
                     "--expert-cache-device", "2=3500", "--expert-cache-device", "3=3500")
    plan = json.loads(as_json.stdout)
    assert [(s["device"], s["lb"], s["le"]) for s in plan["stages"]] == [(0, 0, 30), (1, 30, 48)]
    assert [h["explicit"] for h in plan["helpers"]] == [False, False, True, True]
    assert Plan.from_json(as_json.stdout).to_dict() == plan


@pytest.mark.parametrize("args,needles", [
    (["--expert-cache-device", "2=20000"], ["2=20000", "asked 20000.0 MiB", "15768.0 MiB"]),
    (["--layer-split", "20,30"], ["--layer-split 20,30 makes 3 stages", "--stage-gpus 0,1 names 2"]),
    (["--expert-cache-device", "2:3500"], ["2:3500", "N=MiB"]),
    (["--stage-gpus", "0,7"], ["--stage-gpus 0,7", "no listed device 7"]),
])
def test_cli_refusals_exit_2_naming_both_values(model48, rig, args, needles):
    base = {"--stage-gpus": "0,1", "--layer-split": "30"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    flat = [x for kv in base.items() for x in kv]
    proc = launch("--model", model48, "--inventory", rig, "--plan-only", *flat)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "Traceback" not in proc.stderr
    for n in needles:
        assert n in last, (n, last)


def test_gpu_indices_become_the_ranks_running_them():
    from strata_dist.plan.explicit import ranks_of_gpus
    gpus = [2, 3, 0, 0]                                  # --gpus 2,3,0,0: ranks 2 and 3 share GPU 0
    assert ranks_of_gpus(["3", "0"], gpus, "--stage-gpus 3,0") == ["1", "2", "3"]
    with pytest.raises(PlanError, match=r"--stage-gpus 1: GPU 1 is not in --gpus 2,3,0,0"):
        ranks_of_gpus(["1"], gpus, "--stage-gpus 1")
    with pytest.raises(PlanError, match=r"GPU 0 runs 2 ranks .*a helper tier goes on one"):
        ranks_of_gpus(["0"], gpus, "--expert-cache-device 0=100", one=True)


def test_no_resident_cache_keeps_the_explicit_tier(seed):
    shape, devs = seed
    plan = make_plan(shape, devs, cells=CELLS, split=[30], stage_gpus=["0", "1"],
                     params=PlanParams(stage_cache_slots=0, remote_auto=False),
                     helper_tiers=[ExplicitTier("2", 500 * MIB)])
    assert plan.expert_slots_stages == 0
    assert [h.device.index for h in plan.live_helpers] == [2]
    assert len(plan.live_helpers[0].pairs) == 500 * MIB // SEED_BLOB


def test_cpu_ranks_are_named_by_their_numbers(model48):
    proc = launch("--model", model48, "--plan-only", "--cpu-ranks", "3", "--stage-gpus", "2,0",
                  "--layer-split", "20", "--expert-cache", "2", "--expert-cache-device", "1=1")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line[:1].isdigit()}
    assert "stage 0" in rows["0"] and "[0, 20)" in rows["0"]
    assert "stage 1" in rows["2"] and "[20, 48)" in rows["2"]
    assert "helper (explicit)" in rows["1"] and "stage" not in rows["1"]


def test_stage_cards_too_small_for_the_model_are_refused_with_the_numbers(seed):
    shape, devs = seed
    small = [replace(d, free_bytes=900 * MIB) if d.index < 2 else d for d in devs]
    with pytest.raises(PlanError) as e:
        make_plan(shape, small, cells=CELLS, stage_gpus=["0", "1"])
    msg = str(e.value)
    assert "over the --stage-gpus cards fits" in msg and "0 RTX 3060 900.0, 1 RTX 3060 900.0 MiB" in msg
    assert "MiB at 32768 cells" in msg
