"""The adaptive expert cache (--adapt-every, --adapt-swaps): the swap policy, the arena's swaps, and
real CPU ranks through the launcher on a two-phase workload. The tokens never depend on it."""
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGUFReader

from launch_helpers import ServeSession
from stand_ins import run_check
from strata_dist.experts.adapt import RoutingCounts, coverage, pick_swaps
from strata_dist.backends import get_backend
from strata_dist.experts.stores import BlobArena, HostTier
from strata_dist.gguf_file.reader import GGUFModel
from strata_dist.tools.profile_io import record_profile, save_profile
from strata_dist.rank.stage import Stage, StageConfig
from strata_dist.synth import GEOMETRIES, write_synthetic

TINY = GEOMETRIES["tiny"]
L, E = TINY.n_layer, TINY.n_expert
# the synthetic model routes by token, not context: a phase of a few repeated ids routes to a few
# experts per layer, and another phase's ids to others (checked below from recorded profiles)
PHASE1 = [[11, 12, 13] * 16]
PHASE2 = [[200 + i, 201, 202] * 12 for i in range(3)]


# ---------------------------------------------------------------- the policy (a pure function)
def test_hottest_missed_pairs_take_the_coldest_cached_slots():
    counts = np.array([[9., 0., 5., 1.],
                       [0., 7., 2., 0.]])
    cached = np.array([[False, True, False, True],
                       [True, False, False, True]])
    # missed, hottest first: (0,0)=9, (1,1)=7, (0,2)=5, (1,2)=2; cached, coldest first:
    # (0,1)=0, (1,0)=0, (1,3)=0, (0,3)=1
    assert pick_swaps(counts, cached, 2) == [((0, 1), (0, 0)), ((1, 0), (1, 1))]
    # (1,2)=2 against (0,3)=1 is inside the hysteresis (2 > 1 * 1.25 + 1 fails): 3 swaps, not 4
    assert pick_swaps(counts, cached, 10) == [((0, 1), (0, 0)), ((1, 0), (1, 1)),
                                              ((1, 3), (0, 2))]
    assert pick_swaps(counts, cached, 0) == []


def test_the_hysteresis_keeps_near_ties_in_place_and_a_round_is_stable():
    counts = np.array([[10., 9., 3., 0.]])
    cached = np.array([[False, True, True, False]])
    # 10 against 3: swapped; 10 against 9 would not be (10 > 9 * 1.25 + 1 fails)
    swaps = pick_swaps(counts, cached, 4)
    assert swaps == [((0, 2), (0, 0))]
    cached[0, 2], cached[0, 0] = False, True
    assert pick_swaps(counts, cached, 4) == []      # applied: nothing left to swap (no flapping)
    assert pick_swaps(np.array([[10., 9.]]), np.array([[False, True]]), 4) == []
    # never routed: never taken, even into a slot nobody used either
    assert pick_swaps(np.zeros((1, 4)), cached, 4) == []


def test_a_pair_moves_only_into_a_slot_of_its_size_and_only_evictable_pairs_leave():
    counts = np.array([[0., 20.], [8., 0.], [0., 30.]])
    cached = np.array([[True, False], [False, True], [True, False]])
    sizes = np.array([100, 200, 100])
    # layer 1's pair (1,0)=8 may only take layer 1's slot (1,1); layers 0 and 2 share a size,
    # their two hot pairs take their two cold slots; the largest gain first
    assert pick_swaps(counts, cached, 4, size_class=sizes) == [
        ((0, 0), (2, 1)), ((2, 0), (0, 1)), ((1, 1), (1, 0))]
    assert pick_swaps(counts, cached, 4) == [((0, 0), (2, 1)), ((1, 1), (0, 1)), ((2, 0), (1, 0))]
    evictable = np.array([[True, False], [False, False], [True, False]])
    assert pick_swaps(counts, cached, 4, size_class=sizes, evictable=evictable) == [
        ((0, 0), (2, 1)), ((2, 0), (0, 1))]


def test_counts_decay_and_the_clock_ticks_every_t_tokens():
    r = RoutingCounts((2, 4), every=5, swaps=2)
    r.add(1, np.array([[3, 1], [3, -1]]))
    np.testing.assert_array_equal(r.counts[1], [0, 1, 0, 2])
    graph = RoutingCounts((4, 4), every=5, swaps=2)     # a graph step's routes of layers 1..2
    graph.add_layers(1, np.array([[[0, 2]], [[3, -1]]]))
    np.testing.assert_array_equal(graph.counts, [[0, 0, 0, 0], [1, 0, 1, 0], [0, 0, 0, 1],
                                                 [0, 0, 0, 0]])
    assert [r.tick(2), r.tick(2), r.tick(1), r.tick(4), r.tick(1)] == [False, False, True, False,
                                                                      True]
    r.decay()
    np.testing.assert_array_equal(r.counts[1], [0, 0.5, 0, 1])
    assert coverage(r.counts, r.counts > 0.75) == pytest.approx(1 / 1.5)
    assert not RoutingCounts((1, 1), every=0, swaps=4).on
    assert not RoutingCounts((1, 1), every=4, swaps=0).on
    with pytest.raises(ValueError, match="adapt_every -1"):
        RoutingCounts((1, 1), every=-1, swaps=1)


# ---------------------------------------------------------------- the arena's swaps
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("adapt")
    path = d / "tiny.gguf"
    write_synthetic(path, like="tiny", quant="q8_0", popularity="uniform", seed=0)
    return str(path)


def _reference_blob(path: str, layer: int, expert: int) -> bytes:
    """gguf-py's reading of the expert's gate, up and down rows, in that order."""
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    out = b""
    for part in ("gate", "up", "down"):
        data = np.asarray(tensors[f"blk.{layer}.ffn_{part}_exps.weight"].data)
        out += data[expert].tobytes()
    return out


def test_a_swapped_slot_holds_the_taken_pair_and_computes_it(model):
    gguf, be = GGUFModel(model), get_backend("cpu")
    arena = BlobArena(be, gguf, [(0, 1), (1, 2), (2, 3)], L, E)
    assert arena.swap([((1, 2), (3, 5)), ((0, 1), (0, 6))]) == 2
    assert not arena.holds(1, 2) and not arena.holds(0, 1)
    assert arena.pairs == [(0, 6), (3, 5), (2, 3)]
    for layer, expert in arena.pairs:
        assert bytes(np.asarray(arena.blob(layer, expert))) == _reference_blob(model, layer, expert)
    x = np.random.default_rng(0).standard_normal((3, TINY.n_embd)).astype(np.float32)
    np.testing.assert_array_equal(arena.compute(3, 5, x), HostTier(be, gguf).compute(3, 5, x))
    # a loan lends the swapped pair's slot and gives back the same pair
    arena.lend_tail(2)
    with pytest.raises(RuntimeError, match="lent"):
        arena.swap([((2, 3), (2, 4))])
    arena.refill()
    assert arena.holds(3, 5) and arena.holds(2, 3)
    with pytest.raises(ValueError, match="must be cached"):
        arena.swap([((1, 2), (1, 3))])


# ---------------------------------------------------------------- real ranks, two phases
def _serve(model, profile, *extra):
    return ServeSession(model, "--cpu-ranks", "2", "--layer-split", "2", "--prefill", "16",
                        "--max-context", "512", "--expert-cache", "4", "--expert-profile",
                        str(profile), "--no-remote-auto", *extra)


def _hit_rate(stats: list[dict]) -> float:
    hits = sum(int(r["hits"]) for r in stats)
    return hits / sum(int(r["hits"]) + int(r["remote"]) + int(r["host"]) for r in stats)


def _phase2(model, profile, *extra, max_new=24, rounds=2, options="stats=1"):
    """Phase 2's requests on a cache filled from phase 1's profile: their tokens and hit rates,
    and every rank's counters after."""
    s = _serve(model, profile, *extra)
    try:
        tokens, rates = [], []
        for _ in range(rounds):
            for prompt in PHASE2:
                out = s.gen(prompt, max_new, options)
                assert out["err"] is None, out["err"]
                tokens.append(out["tokens"])
                rates.append(_hit_rate(out["stats"]))
        return tokens, rates, s.stats()
    finally:
        assert s.close() == 0


@pytest.fixture(scope="module")
def phase1_profile(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("adapt-profile") / "phase1.json"
    save_profile(record_profile(model, PHASE1), path)
    return path


def test_the_phases_route_to_different_experts(model):
    one, two = record_profile(model, PHASE1).counts, record_profile(model, PHASE2).counts
    # a static cache from phase 1's profile (each stage's 4 hottest pairs, as _serve's plan
    # fills it) holds far less of phase 2's routing than of phase 1's
    held = np.zeros((L, E), dtype=bool)
    for lb in (0, 2):
        top = np.argsort(-one[lb:lb + 2].ravel(), kind="stable")[:4]
        held[lb + top // E, top % E] = True
    assert coverage(two, held) < coverage(one, held) - 0.1


def test_adapting_raises_the_second_phases_hit_rate_with_the_same_tokens(model, phase1_profile):
    off_tokens, off_rates, off_counters = _phase2(model, phase1_profile)
    on_tokens, on_rates, counters = _phase2(model, phase1_profile, "--adapt-every", "16",
                                               "--adapt-swaps", "4")
    assert on_tokens == off_tokens
    assert all("adapt_rounds" not in c for c in off_counters.values())   # off by default
    assert sum(int(c.get("adapt_swaps", 0)) for c in counters.values()) > 0
    # the coverage as it changes: in STATS, a level in millionths
    assert all(0 < int(c["adapt_coverage_ppm"]) <= 10 ** 6 for c in counters.values())
    # after the first request has been counted, every request hits more than the static cache
    assert all(on > off + 0.05 for on, off in zip(on_rates[1:], off_rates[1:])), (on_rates,
                                                                                  off_rates)
    assert np.mean(on_rates[1:]) > np.mean(off_rates[1:]) + 0.1


def test_swaps_every_token_keep_the_tokens(model, phase1_profile):
    """A swap round after every step of every stage over a few hundred tokens: the tokens are
    those of a static cache, and nothing fails. Sampled (seeded), not greedy: a draw moves with
    any change of the distribution, where this random model's argmax would hide one."""
    sampled = "stats=1 temperature=1.5 seed=7"
    off, _, _ = _phase2(model, phase1_profile, max_new=100, rounds=2, options=sampled)
    on, _, counters = _phase2(model, phase1_profile, "--adapt-every", "1", "--adapt-swaps", "4",
                              max_new=100, rounds=2, options=sampled)
    assert sum(map(len, on)) >= 200
    assert on == off
    for c in counters.values():
        assert int(c.get("errors", 0)) == 0
        assert int(c["adapt_rounds"]) >= 100 and int(c["adapt_swaps"]) > 0


def _stage_run(model, adapt: bool, prompts, max_new: int):
    """One whole-model stage with a 6-pair cache lending 2 slots to each prompt: every prompt in
    chunks of 8, then greedy decode steps; the logits of every step, and the stage."""
    stage = Stage(StageConfig(model, "cpu", 0, L, True, True, 256,
                              cache_pairs=[(l, 0) for l in range(L)] + [(0, 1), (1, 1)],
                              loan_slots=2, adapt_every=1 if adapt else 0, adapt_swaps=4))
    logits = []
    for sid, prompt in enumerate(prompts):
        stage.begin_prompt()
        for pos in range(0, len(prompt), 8):
            out = stage.run(sid, pos, ids=prompt[pos:pos + 8], prompt=True)
        stage.end_prompt()
        pos = len(prompt)
        for _ in range(max_new):
            logits.append(out)
            out = stage.run(sid, pos, ids=[int(np.argmax(out))])
            pos += 1
    return logits, stage


def test_swaps_every_step_around_prompt_loans_read_only_whole_slots(model):
    """Rounds after every chunk and step while prompts borrow the cache's tail: no swap while the
    tail is lent (the arena refuses one), every slot holds its own pair's blob after, and the
    logits are bit for bit those of a static cache."""
    prompts = PHASE2 + PHASE1
    static, _ = _stage_run(model, False, prompts, 40)
    adapted, stage = _stage_run(model, True, prompts, 40)
    c = stage.tiers.counters
    assert c["loans"] == len(prompts) and c["refilled_slots"] > 0
    assert c["adapt_swaps"] > 0 and c["adapt_rounds"] > 100
    for a, b in zip(static, adapted):
        np.testing.assert_array_equal(a, b)
    for i, (layer, expert) in enumerate(stage.cache.pairs):
        assert stage.cache.slot_of[layer, expert] == i
        assert bytes(np.asarray(stage.cache.blob(layer, expert))) == _reference_blob(model, layer,
                                                                                   expert)


@pytest.mark.parametrize("flag", ["--adapt-every", "--adapt-swaps"])
def test_a_negative_flag_is_one_error_line(flag, model):
    p = subprocess.run([sys.executable, "-m", "launcher.cli", "--model", model, "--serve", flag,
                        "-1"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [f"error: {flag} -1: expected a number >= 0 (0: off)"]


def test_an_assign_with_a_negative_adapt_field_is_refused():
    from protocol.messages import Assign
    ok = dict(rank=0, role="stage", lb=0, le=1, first=True, last=True, device="cpu", plan={})
    Assign(**ok, adapt_every=100, adapt_swaps=16).check([])
    for name in ("adapt_every", "adapt_swaps"):
        with pytest.raises(ValueError, match=name):
            Assign(**ok, **{name: -1}).check([])


def test_a_gpu_stage_swaps_between_graph_steps_and_repoints_its_graph():
    """The GPU rank's Python on tests/fake_cupy (tests/adapt_gpu_check.py): the swaps copy the
    pinned blobs into their slots, and the graph's table updated in place equals one built afresh.
    The kernels themselves are the GPU tests' (test_gpu_adaptive_cache.py)."""
    report = run_check("adapt_gpu_check.py", timeout=240)
    assert report["graph"] == "DecodeGraph" and report["graph_steps"] == 8, report
    # the stand-ins route every row to expert 0: it takes a slot in both layers
    assert report["adapt_swaps"] == 2 and [0, 0] in report["cached"] and [1, 0] in report["cached"]
    assert report["same_table"] and report["same_hits"] and report["slots_hold_their_pairs"]
    # a stage counting for a profile (--expert-profile-out) with no miss: its graph brings every
    # step's routes back all the same, 4 steps x top-4 on expert 0 of each of its 2 layers
    assert report["profile_graph_steps"] == 4
    assert report["profile_total"] == [[0] * 16] * 2 + [[16] + [0] * 15] * 2


def test_a_graph_built_with_no_miss_reads_an_evicted_pair_from_the_pinned_tier():
    """A GPU stage whose cache and own helper tier held every pair when its graph was built (its
    table read no pinned copy): the adaptive cache evicts a cached pair that has its copy in the
    stage's pinned tier (Stage._adapt evicts only those), and the graph's table built again reads
    it there (experts/addresses.py stage_addresses), as a table built afresh does
    (tests/adapt_helper_check.py on the stand-ins)."""
    report = run_check("adapt_helper_check.py", timeout=240)
    assert report["built_with_no_pinned"] and report["adapt_swaps"] >= 1, report
    assert report["error"] == "" and len(report["evicted"]) == report["adapt_swaps"], report
    assert report["evicted_pinned"] and report["same_table"] and report["same_hits"], report
    assert not report["graph_rebuilt"], report


def test_a_repoint_the_graph_cannot_follow_builds_the_graph_afresh():
    """The same stage, its graph's repoint refusing the swapped table (Unsupported, injected: the
    builder refuses only rare layouts): the slots it reads now hold other pairs, so the stage
    builds its graph afresh (Stage._adapt) and the step that swapped still runs, its new table
    the fresh one's."""
    report = run_check("adapt_helper_check.py", "--repoint-fails", timeout=240)
    assert report["error"] == "" and report["adapt_swaps"] >= 1, report
    assert report["graph_rebuilt"] and report["same_table"] and report["same_hits"], report
