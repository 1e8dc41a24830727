"""Expert tiers on CPU ranks: stage caches, helper tiers (on stage cards and on a card that runs
no stage), host misses. The tokens never depend on where an expert was computed."""

import numpy as np
import pytest

from hf_fixtures import tiny_qwen3moe, write_gguf
from launch_helpers import ServeSession, generate_killing, rank_pids
from strata_dist.backends import get_backend
from strata_dist.tools.single_process import SingleProcessRunner
from strata_dist.experts.stores import BlobArena, HostTier
from strata_dist.gguf_file.reader import GGUFModel
from strata_dist.rank.stage import Stage, StageConfig

CHUNK = 16
PROMPT = [int(x) for x in np.random.default_rng(8).integers(0, 320, 40)]
N_LAYERS, TOP_K = 6, 2


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_gguf(tiny_qwen3moe(13, hidden=64, top_k=TOP_K, n_experts=8, n_layers=N_LAYERS),
                      tmp_path_factory.mktemp("tiers") / "m.gguf", "q8_0")


@pytest.fixture(scope="module")
def baseline(model):
    return SingleProcessRunner(model, prompt_chunk=CHUNK, max_context=512).generate(PROMPT, 64).tokens


def _launch(model, n_ranks, split, *extra, env=None):
    args = ["--cpu-ranks", str(n_ranks), "--layer-split", split, "--prefill", str(CHUNK),
            "--max-context", "512", "--gpu-order", "as_given", *extra]
    return ServeSession(model, *args, env=env)


ARMS = {  # name: (ranks, split, flags, env, cache, helpers)
    "2 stages, full caches, no helpers": (2, "3", ["--no-remote-auto"], None, "all", False),
    "2 stages, no cache": (2, "3", ["--expert-cache", "0"], None, "none", False),
    "2 stages, some cache, helpers on stage cards": (2, "3", [], {"STRATA_STAGE_CACHE_SLOTS": "5"},
                                                     "some", True),
    "3 stages, some cache, no helpers": (3, "2,4", ["--no-remote-auto"],
                                         {"STRATA_STAGE_CACHE_SLOTS": "4"}, "some", False),
    "3 stages, some cache, helpers": (3, "2,4", [], {"STRATA_STAGE_CACHE_SLOTS": "4"}, "some", True),
    "2 stages + a helper-only rank": (3, "3", [], {"STRATA_STAGE_CACHE_SLOTS": "3"}, "some", True),
}


@pytest.mark.parametrize("arm", list(ARMS))
def test_placement_invariance_and_counters(model, baseline, arm):
    n, split, flags, env, cache, helpers = ARMS[arm]
    s = _launch(model, n, split, *flags, env=env)
    try:
        out = s.gen(PROMPT, 64, "stats=1")
        assert out["err"] is None, out["err"]
        assert out["tokens"] == baseline
        stats = out["stats"]
        total = sum(int(r["hits"]) + int(r["remote"]) + int(r["host"]) for r in stats)
        steps = len(PROMPT) + len(out["tokens"]) - 1      # the last token is not read
        assert total == steps * N_LAYERS * TOP_K
        # no tier went silent (a stage asking its own card's tier over a socket would)
        assert sum(int(r["remote_lost"]) for r in stats) == 0
        hits = sum(int(r["hits"]) for r in stats)
        remote = sum(int(r["remote"]) for r in stats)
        if cache == "none":
            assert hits == 0 and remote == 0
        elif cache == "all":
            assert hits == total
        else:
            assert 0 < hits < total
        if helpers:
            assert remote > 0, stats
            assert sum(int(r["helper_requests"]) for r in stats) > 0
        else:
            assert remote == 0
        if "helper-only" in arm:
            info = s.info_fields()
            assert any(f.get("role") == "helper" and float(f["helper_mib"]) > 0 for f in info)
        # a second request's counters are its own (deltas, not totals since start)
        again = s.gen(PROMPT + [1], 4, "stats=1")
        total2 = sum(int(r["hits"]) + int(r["remote"]) + int(r["host"]) for r in again["stats"])
        assert total2 == (len(PROMPT) + 1 - again["resume"] + 3) * N_LAYERS * TOP_K
    finally:
        assert s.close() == 0


def test_every_slot_holds_its_own_layers_expert(model):
    """A pair served from another layer's slot still yields fluent tokens; this catches it."""
    gguf = GGUFModel(model)
    be = get_backend("cpu")
    pairs = [(l, e) for l in range(N_LAYERS) for e in (0, 3, 5)]
    arena = BlobArena(be, gguf, pairs, N_LAYERS, 8)
    host = HostTier(be, gguf)
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    for l, e in pairs:
        np.testing.assert_array_equal(arena.compute(l, e, x), host.compute(l, e, x))
    # the check is sensitive: a residency table pointing one layer off gives other outputs
    arena.slot_of[1, 3], arena.slot_of[2, 3] = arena.slot_of[2, 3], arena.slot_of[1, 3]
    assert not np.array_equal(arena.compute(1, 3, x), host.compute(1, 3, x))


def test_a_stage_refuses_pairs_of_other_layers(model):
    with pytest.raises(ValueError, match="other layers"):
        Stage(StageConfig(model, "cpu", 2, 4, False, False, 64, cache_pairs=[(2, 0), (5, 1)]))


def test_killing_a_helper_rank_mid_generation_recovers_with_the_same_tokens(model, baseline):
    s = _launch(model, 3, "3", env={"STRATA_STAGE_CACHE_SLOTS": "3"})
    try:
        helper = rank_pids(s)[2]
        assert any(f.get("role") == "helper" for f in s.info_fields())
        assert generate_killing(s, PROMPT, 64, helper, after=5, timeout=30) == baseline
        assert s.err_has("helper rank 2 is gone", timeout=10)
        assert s.gen(PROMPT, 8)["tokens"] == baseline[:8]   # the run goes on without the tier
    finally:
        s.close()


def test_a_cpu_helper_refuses_an_ipc_offer_and_keeps_serving_frames(model, tmp_path):
    """A stage may offer its CUDA IPC buffer to a helper it cannot tell is on a CPU: the helper
    answers Error(code="ipc") and the link stays on frames; rows said to be in a slot it never
    opened get an error, not a guess. Real sockets, the rank's own serving code."""
    from protocol import Channel, Error, ExpertReply, ExpertRequest, IpcHandle
    from protocol.messages import Assign, DeviceInfo, RowSlot
    from strata_dist.rank.shell import RankOptions, RankProcess
    from strata_dist.experts.helper_server import HelperServer, serve_request

    gguf = GGUFModel(model)
    be = get_backend("cpu")
    pairs = [(1, e) for e in range(8)]
    rp = RankProcess(RankOptions(coordinator="tcp://127.0.0.1:9", model=str(model),
                                 device=DeviceInfo(kind="cpu", name="cpu", index=0, total_bytes=1,
                                                   free_bytes=1),
                                 device_name="cpu", secret=b"s" * 32, data_bind="tcp://127.0.0.1:*"))
    try:
        rp.assign = Assign(rank=2, role="helper", lb=0, le=0, first=False, last=False, device="cpu",
                           plan={})
        rp.helper = HelperServer(2, BlobArena(be, gguf, pairs, N_LAYERS, 8))
        endpoint = rp.helper_socket.bind(f"ipc://{tmp_path}/helper.sock")
        stage = Channel("dealer", peer="helper").connect(endpoint)

        def ask(msg, arrays=()):
            stage.send(msg, list(arrays), timeout_ms=2000)
            rp._answer_helper_request()
            return stage.recv(timeout_ms=2000)

        reply, _ = ask(IpcHandle(name="expert_rows", handle=bytes(64), device=0, nbytes=1 << 20,
                                 dtype="float32", host="h", pid=1))
        assert isinstance(reply, Error) and reply.code == "ipc" and "not on a GPU" in reply.message
        x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
        ids = np.array([[1, -1], [3, 5]], dtype=np.int32)
        wts = np.zeros((2, 2), dtype=np.float32)
        reply, _ = ask(ExpertRequest(seq=1, layer=1, n=2, slot=RowSlot(offset=0, nbytes=x.nbytes),
                                     out=RowSlot(offset=4096, nbytes=4 * x.nbytes)), [ids, wts])
        assert isinstance(reply, Error) and "never opened" in reply.message
        msg = ExpertRequest(seq=2, layer=1, n=2)
        reply, arrays = ask(msg, [x, ids, wts])
        assert isinstance(reply, ExpertReply) and reply.seq == 2 and reply.slot is None
        np.testing.assert_array_equal(arrays[0], serve_request(rp.helper.arena, msg, [x, ids, wts]))
        stage.close()
    finally:
        rp.close()


def test_each_expert_takes_the_first_tier_that_holds_it(model):
    """The stage's cache, then its own card's helper tier, then a live helper tier elsewhere (of a
    pair two helpers list, the later one's), else host memory; a prompt chunk asks no other card's
    helper (its own card's tier is computed in place). A dead helper's experts go to host memory."""
    from strata_dist.experts.tiers import ExpertTiers, HelperClient
    be, gguf = get_backend("cpu"), GGUFModel(model)
    cache = BlobArena(be, gguf, [(1, 0), (1, 1)], N_LAYERS, 8)
    local = BlobArena(be, gguf, [(1, 1), (1, 2)], N_LAYERS, 8)
    first = HelperClient(7, "tcp://127.0.0.1:9", [(1, 2), (1, 3), (1, 4), (2, 6)])
    later = HelperClient(8, "tcp://127.0.0.1:9", [(1, 4), (1, 5)])
    tiers = ExpertTiers(be, gguf, cache, [first, later], local_helper=local)
    try:
        tier_of, helper_of = tiers._tiers_of(1)
        assert list(tier_of) == [1, 1, 3, 2, 2, 2, 0, 0]
        assert list(helper_of[3:6]) == [0, 1, 1]
        later.alive = False
        assert list(tiers._tiers_of(1)[0]) == [1, 1, 3, 2, 0, 0, 0, 0]
        tiers.prompt = True
        assert list(tiers._tiers_of(1)[0]) == [1, 1, 3, 0, 0, 0, 0, 0]
    finally:
        for h in (first, later):
            h.ch.close()
