"""A helper tier re-ranks with the adaptive cache (strata_dist/experts/helper_server.py): real CPU ranks
through the launcher, two stages and a helper-only rank whose explicit tier serves both, a
round after every step of every stage. The tokens are those with adaptation off, the tier swaps,
and a stage that asks for a pair that left the tier before it heard is answered all the same."""
from dataclasses import replace

import numpy as np
import pytest

from launch_helpers import ServeSession
from strata_dist.experts.helper_server import HelperServer
from strata_dist.tools.profile_io import record_profile, save_profile
from strata_dist.synth import GEOMETRIES, write_synthetic

# q8_0 blobs of 3 x 256 x 256 weights (208 KiB): a 1 MiB tier holds 5 of the 32 pairs
GEOMETRY = replace(GEOMETRIES["tiny"], name="wide8", n_embd=256, n_ff_exp=256, n_expert=8,
                   n_head=4, n_head_kv=2, head_dim=64)
L, E = GEOMETRY.n_layer, GEOMETRY.n_expert
# the synthetic model routes by token: each phase's few ids route to few experts per layer
PHASE1 = [[11, 12, 13] * 16]
PHASE2 = [[200 + i, 201, 202] * 12 for i in range(3)]
SAMPLED = "stats=1 temperature=1.5 seed=7"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tier-adapt")
    model = d / "wide8.gguf"
    write_synthetic(model, like=GEOMETRY, quant="q8_0", popularity="uniform", seed=0)
    profile = d / "phase1.json"
    save_profile(record_profile(model, PHASE1), profile)
    return str(model), str(profile)


# two stages and a helper-only rank; or two stages each with a tier on its own card, which serves
# the other stage (asked) and its own (computed in place, re-ranked there with no message)
HELPER_RANK = ("--cpu-ranks", "3", "--expert-cache-device", "rank:2=1")
STAGE_CARDS = ("--cpu-ranks", "2", "--expert-cache-device", "rank:0=1,rank:1=1")


def _phase2(files, *extra, options=SAMPLED, max_new=40, layout=HELPER_RANK):
    """Phase 2's requests, sampled, on tiers filled from phase 1's profile: the tokens, the
    helper tiers' share of the routing per request (remote / all routed) and every rank's
    counters after."""
    model, profile = files
    s = ServeSession(model, *layout, "--stage-gpus", "rank:0,rank:1", "--layer-split", "2",
                     "--expert-cache", "1", "--no-remote-auto", "--prefill", "16",
                     "--max-context", "512", "--expert-profile", profile, *extra, timeout=120)
    try:
        tokens, served = [], []
        for _ in range(2):
            for prompt in PHASE2:
                out = s.gen(prompt, max_new, options, timeout=120)
                assert out["err"] is None, out["err"]
                tokens.append(out["tokens"])
                rows = out["stats"]
                routed = sum(int(r["hits"]) + int(r["remote"]) + int(r["host"]) for r in rows)
                served.append(sum(int(r["remote"]) for r in rows) / routed)
        return tokens, served, s.stats()
    finally:
        assert s.close() == 0


def test_a_helper_tier_reranks_every_step_with_the_same_tokens(files):
    off, _, off_counters = _phase2(files)
    on, _, counters = _phase2(files, "--adapt-every", "1", "--adapt-swaps", "4")
    assert sum(map(len, on)) >= 200
    assert on == off
    helper = counters[2]
    assert "tier_rounds" not in off_counters[2]          # off by default
    # a round per step of each stage, and the tier's slots moved between the stages' layers
    assert int(helper["tier_rounds"]) >= 200 and int(helper["tier_swaps"]) > 0, helper
    # stage 0's rounds evict pairs of stage 1's layers before stage 1 hears: asked all the same
    assert int(helper["tier_left_asked"]) > 0, helper
    for rank in (0, 1):
        assert int(counters[rank].get("errors", 0)) == 0
        assert int(counters[rank].get("remote_lost", 0)) == 0


def test_the_tiers_on_the_stages_own_cards_rerank_every_step_with_the_same_tokens(files):
    """Each stage card's tier re-ranks on both stages' counts: its own stage's, handed over in
    the process, and the other's, sent. Fewer tokens: the layout is what is new here."""
    off, _, _ = _phase2(files, layout=STAGE_CARDS, max_new=20)
    on, _, counters = _phase2(files, "--adapt-every", "1", "--adapt-swaps", "4",
                              layout=STAGE_CARDS, max_new=20)
    assert on == off
    for rank in (0, 1):
        c = counters[rank]
        # two rounds a step: its own stage's and the other stage's
        assert int(c["tier_rounds"]) >= 2 * sum(map(len, on)) - 12 and int(c["tier_swaps"]) > 0, c
        assert int(c.get("errors", 0)) == 0 and int(c.get("remote_lost", 0)) == 0



def test_a_reranked_tier_holds_more_of_the_second_phase(files):
    """Rounds every 16 tokens, greedy: the tier ends holding more of the stages' recent missed
    routing than the pairs the plan gave it from phase 1's profile would (its coverage levels in
    STATS), and serves more of phase 2's lookups than the tier that stays as planned. Prompt
    chunks never ask a helper, so its share is of the decode rows only."""
    _, off, _ = _phase2(files, options="stats=1", max_new=24)
    _, on, counters = _phase2(files, "--adapt-every", "16", "--adapt-swaps", "4",
                              options="stats=1", max_new=24)
    helper = counters[2]
    assert int(helper["tier_swaps"]) > 0
    assert (int(helper["tier_coverage_ppm"])
            > int(helper["tier_planned_coverage_ppm"]) + 100_000), helper
    assert np.mean(on[1:]) > np.mean(off[1:]), (on, off)


def test_a_slot_moves_from_one_stages_layers_to_anothers(files):
    """The tier ranks over every stage's latest counts: a pair of stage [2, 4)'s layers that its
    stage no longer routes to gives its slot to a hot pair of stage [0, 2)'s layers; the answer
    to each stage names only its own layers' pairs."""
    from strata_dist.backends import get_backend
    from strata_dist.gguf_file.reader import GGUFModel
    tier = HelperServer.open(2, get_backend("cpu"), GGUFModel(files[0]), [(0, 1), (2, 1), (3, 1)],
                             L, E, adapt_swaps=4)
    warm = np.zeros((2, E))
    warm[:, 1] = 10.0                       # stage [2, 4) routes to its two held pairs
    assert tier.rerank(2, 4, warm) == ([(2, 1), (3, 1)], 0)
    hot = np.zeros((2, E))
    hot[0, 1], hot[1, 7] = 10.0, 12.0        # stage [0, 2): (1, 7) is routed and held nowhere
    assert tier.rerank(0, 2, hot) == ([(0, 1)], 0)   # nothing colder than 10 * 1.25 + 1 ...
    warm[1, 1] = 0.0                        # ... until stage [2, 4) stops routing to (3, 1)
    assert tier.rerank(2, 4, warm) == ([(2, 1)], 1)
    assert tier.rerank(0, 2, hot) == ([(0, 1), (1, 7)], 0) and tier.left == {(3, 1)}


def test_a_tier_read_in_place_never_swaps_and_bad_counts_are_refused(files):
    """A tier whose addresses a decode graph holds (ExpertTierAsk answered) keeps its pairs; counts
    of another shape, negative or not finite, are refused naming the layers."""
    from strata_dist.backends import get_backend
    from strata_dist.gguf_file.reader import GGUFModel
    gguf = GGUFModel(files[0])
    pairs = [(0, 0), (1, 0)]
    tier = HelperServer.open(2, get_backend("cpu"), gguf, pairs, L, E, adapt_swaps=2)
    hot = np.zeros((2, E))
    hot[:, 5] = 50.0
    tier.read_in_place = True
    assert tier.rerank(0, 2, hot) == (pairs, 0)
    tier.read_in_place = False
    held, swaps = tier.rerank(0, 2, hot)
    assert swaps == 2 and sorted(held) == [(0, 5), (1, 5)] and tier.left == set(pairs)
    for bad in (np.zeros((1, E)), np.full((2, E), -1.0), np.full((2, E), np.nan)):
        with pytest.raises(ValueError, match=r"layers \[0, 2\)"):
            tier.rerank(0, 2, bad)


def test_a_tier_is_given_the_counts_of_pairs_no_other_tier_holds(files):
    """A stage's round hands this card's tier its counts less the pairs its own cache holds and
    those another card's tier holds: two tiers never take the same hot pair."""
    from strata_dist.backends import get_backend
    from strata_dist.gguf_file.reader import GGUFModel
    from strata_dist.rank.stage import Stage, StageConfig
    from strata_dist.experts.tiers import HelperClient
    tier = HelperServer.open(0, get_backend("cpu"), GGUFModel(files[0]), [(0, 3), (1, 3)], L, E,
                             adapt_swaps=0)
    stage = Stage(StageConfig(files[0], "cpu", 0, 2, True, False, 64, cache_pairs=[(0, 1)],
                              local_helper=tier.arena, adapt_every=1, adapt_swaps=1))
    stage.local_tier = tier
    other = HelperClient(1, "ipc:///nonexistent-helper", [(1, 2)])   # another card's tier
    other.alive = False                                               # never asked here
    stage.tiers.helpers.append(other)
    stage.routing.counts[:2] = 5.0
    stage._rerank_helpers(stage.cache.slot_of >= 0)
    given = tier.counts[:2]
    assert given[0, 1] == 0 and given[1, 2] == 0      # this cache's pair, the other tier's pair
    assert given[0, 3] == 5 and given[1, 3] == 5      # its own pairs: their heat, to rank them
    assert (given == 0).sum() == 2
    other.ch.close()


def _stage_beside_two_tiers(files, tmp_path, read_in_place: bool = False):
    """A stage of layers [0, 2) holding (0, 1) in its cache, beside two tiers that may take pairs:
    this card's own (pairs (0, 3) and (1, 3); `read_in_place`: as a GPU stage's graph reads it,
    which never swaps) and another card's, alive behind a real link (pair (1, 2)), whose counts
    the returned router receives. Returns (stage, this card's tier, router, the other's client)."""
    from protocol.transport import RouterChannel
    from strata_dist.backends import get_backend
    from strata_dist.gguf_file.reader import GGUFModel
    from strata_dist.rank.stage import Stage, StageConfig
    from strata_dist.experts.tiers import HelperClient
    tier = HelperServer.open(0, get_backend("cpu"), GGUFModel(files[0]), [(0, 3), (1, 3)], L, E,
                             adapt_swaps=int(read_in_place))
    tier.read_in_place = read_in_place
    stage = Stage(StageConfig(files[0], "cpu", 0, 2, True, False, 64, cache_pairs=[(0, 1)],
                              local_helper=tier.arena, adapt_every=1, adapt_swaps=1))
    stage.local_tier = tier
    router = RouterChannel(peer="the other tier")
    endpoint = router.bind(f"ipc://{tmp_path}/other-tier")
    other = HelperClient(1, endpoint, [(1, 2)])
    stage.tiers.helpers.append(other)
    return stage, tier, router, other


def test_a_pair_no_tier_holds_is_offered_to_one_tier_only(files, tmp_path):
    """Two tiers that may swap (this card's own and another card's, which hears its counts over a
    real link): a hot pair none holds is in the counts of one of them only, so both cannot take
    it in one round; each still gets the heat of its own pairs."""
    from protocol import TierCounts
    stage, tier, router, other = _stage_beside_two_tiers(files, tmp_path)
    try:
        stage.routing.counts[:2] = 5.0
        stage._rerank_helpers(stage.cache.slot_of >= 0)
        _, msg, arrays = router.recv(5000, what="the stage's tier counts")
        assert isinstance(msg, TierCounts) and (msg.lb, msg.le) == (0, 2)
        given = {"own card": tier.counts[:2], "other card": arrays[0]}
        assert given["own card"][0, 3] == 5 and given["other card"][1, 2] == 5   # their own pairs
        for name, counts in given.items():
            assert counts[0, 1] == 0, name                     # this stage's cache holds it
        assert given["own card"][1, 2] == 0 and given["other card"][0, 3] == 0
        unheld = np.ones((2, E), dtype=bool)
        for l, e in [(0, 1), (0, 3), (1, 3), (1, 2)]:
            unheld[l, e] = False
        offered = (given["own card"] > 0).astype(int) + (given["other card"] > 0)
        assert (offered[unheld] == 1).all(), offered       # each to exactly one tier
        assert (given["own card"][unheld] > 0).any() and (given["other card"][unheld] > 0).any()
    finally:
        other.ch.close()
        router.close()


def test_a_missed_pair_goes_to_the_tier_whose_coldest_slot_is_coldest():
    """tiers.offer_missed matches missed pairs to tiers as pick_swaps matches them to slots: the
    k-th hottest to the tier of the k-th coldest visible slot over every tier; a pair still
    awaiting a tier's answer stays with it; a size class none holds is spread by position."""
    from strata_dist.experts.tiers import offer_missed
    counts = np.zeros((2, 8))
    a, b = np.zeros((2, 8), dtype=bool), np.zeros((2, 8), dtype=bool)
    a[0, 0], a[0, 1] = True, True
    b[1, 0] = True
    counts[0, 0], counts[0, 1], counts[1, 0] = 6.0, 9.0, 2.0      # b's slot is the coldest
    counts[0, 4], counts[1, 6], counts[1, 7] = 20.0, 15.0, 3.0
    missed = (counts > 0) & ~a & ~b
    to = offer_missed(counts, missed, [a, b])
    # hottest (0, 4) to b (slot at 2), next (1, 6) to a (slot at 6), the third to a (slot at 9)
    assert (to[0, 4], to[1, 6], to[1, 7]) == (1, 0, 0)
    assert (to[~missed] == -1).all()
    b_hot = counts.copy()
    b_hot[1, 0] = 30.0                                             # now a's slot at 6 is coldest
    assert offer_missed(b_hot, missed, [a, b])[0, 4] == 0
    pending = np.full((2, 8), -1)
    pending[0, 4] = 1                                              # offered to b, unanswered
    assert offer_missed(b_hot, missed, [a, b], pending=pending)[0, 4] == 1
    # layer 1 a size class of its own that no tier holds a slot of: by position
    sized = offer_missed(counts, missed & ~b, [a, np.zeros_like(b)], size_class=np.array([0, 1]))
    assert (sized[1, 6], sized[1, 7]) == ((8 + 6) % 2, (8 + 7) % 2) and sized[0, 4] == 0


def test_a_stage_offers_a_hot_missed_pair_to_the_tier_that_gains_most(files, tmp_path):
    """Through a real stage and a real link: this card's tier holds warm pairs, another card's
    tier a cold one, so the hot pair none holds goes to the other card's tier (by index it went to
    this card's); while that tier has not answered the round, it is offered there again even
    when the heat turns; once it answers without the pair, the pair goes where it gains most."""
    from protocol import TierCounts, TierPairs
    stage, tier, router, other = _stage_beside_two_tiers(files, tmp_path)

    def round_():
        stage._rerank_helpers(stage.cache.slot_of >= 0)
        identity, msg, arrays = router.recv(5000, what="the stage's tier counts")
        assert isinstance(msg, TierCounts) and (msg.lb, msg.le) == (0, 2)
        return identity, msg.seq, arrays[0], tier.counts[:2].copy()
    try:
        counts = stage.routing.counts
        counts[0, 3], counts[1, 3], counts[1, 2] = 6.0, 7.0, 1.0   # the other card's slot: coldest
        counts[0, 4] = 20.0                                      # hot, held by no tier
        _, _, theirs, ours = round_()
        assert theirs[0, 4] == 20.0 and ours[0, 4] == 0
        counts[1, 2], counts[0, 3] = 30.0, 1.0                   # the heat turns: ours is coldest
        identity, seq, theirs, ours = round_()
        assert theirs[0, 4] == 20.0 and ours[0, 4] == 0          # not answered yet: still theirs
        router.send(identity, TierPairs(seq=seq, pairs=[[1, 2]], swaps=0))
        # the answer is there before the next round looks (it takes only what has arrived): a
        # fixed sleep may end before it on a loaded machine
        assert other.ch.poll(5000), "the tier's answer never reached the stage"
        _, _, theirs, ours = round_()
        assert theirs[0, 4] == 0 and ours[0, 4] == 20.0          # declined: now to this card's
        assert theirs[1, 2] == 30.0 and ours[0, 3] == 1.0        # each still ranks its own
    finally:
        other.ch.close()
        router.close()


def test_a_tier_read_in_place_is_offered_no_missed_pair(files, tmp_path):
    """This card's own tier read in place (a GPU stage's decode graph reads its addresses) never
    swaps: a hot pair no tier holds goes to the other card's tier even where this card's tier has
    the coldest slot (offered to this one, it would never be taken by any), and this card's tier
    still gets the counts of the pairs it holds."""
    from protocol import TierCounts
    stage, tier, router, other = _stage_beside_two_tiers(files, tmp_path, read_in_place=True)
    try:
        counts = stage.routing.counts
        counts[0, 3], counts[1, 3], counts[1, 2] = 1.0, 7.0, 30.0   # this card's slot: coldest
        counts[0, 4] = 20.0                                      # hot, held by no tier
        stage._rerank_helpers(stage.cache.slot_of >= 0)
        _, msg, arrays = router.recv(5000, what="the stage's tier counts")
        assert isinstance(msg, TierCounts)
        theirs, ours = arrays[0], tier.counts[:2]
        assert theirs[0, 4] == 20.0 and ours[0, 4] == 0
        assert (ours[0, 3], ours[1, 3]) == (1.0, 7.0) and theirs[1, 2] == 30.0
        assert (tier.arena.slot_of >= 0).sum() == 2 and tier.arena.slot_of[0, 3] >= 0   # no swap
    finally:
        other.ch.close()
        router.close()
