"""Kept conversations (--conversation-cache-mib): a request resumes from the longest prefix of ANY
kept conversation, not only the previous request's.

Real rank processes (CPU) through the --serve line protocol and real HTTP: eight conversations
interleaved, each follow-up reading only its new tokens, with the tokens of the same requests run
with the cache off; eviction at a small budget falling back to a full read; a qwen3next model
restoring only at a kept conversation's exact length; reuse only within one cache_salt. In
process: the stage's copies (restored bytes equal the kept ones, the budget, LRU order, a
recurrent state refused at any other length) and the planner's price equal to the carve."""
import httpx
import numpy as np
import pytest

from hf_fixtures import tiny_qwen3moe
from hf_fixtures import write_gguf as write_moe_gguf
from hf_next_fixtures import tiny_qwen3next, write_gguf as write_next_gguf
from launch_helpers import ServeSession
from launcher.cli import main as launch_main
from server_helpers import ServerProcess
from strata_dist.rank.conversation_cache import ConversationCache, conversation_nbytes, kv_parts
from strata_dist.head.conversation_table import ConversationTable
from strata_dist.plan import PlanError, make_plan
from strata_dist.plan.plan import Plan
from strata_dist.rank.stage import Stage, StageConfig
from strata_dist.synth import write_synthetic
from test_plan_fixtures import MIB, hybrid_kinds, make_devices, make_shape

VOCAB = 320
CTX = 256
N_NEW = 4


def _ids(rng, n):
    return [int(x) for x in rng.integers(0, VOCAB, n)]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return write_moe_gguf(tiny_qwen3moe(11, hidden=64, top_k=2, n_layers=4),
                          tmp_path_factory.mktemp("conv") / "moe.gguf", "f32")


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """8 layers, attention at 3 and 7."""
    return write_next_gguf(tiny_qwen3next(4, hidden=64, top_k=2),
                           tmp_path_factory.mktemp("conv") / "next.gguf", "f32")


def _run(model, mib: str, requests, *args):
    """Each request of `requests(previous outcomes)` in turn on one --serve launch; the outcomes
    and every rank's counters."""
    s = ServeSession(model, "--cpu-ranks", "2", "--prefill", "16", "--max-context", str(CTX),
                     "--vram-budget", "1G", "--conversation-cache-mib", mib, *args)
    try:
        info = s.info_fields()
        outs = []
        for ids in requests(outs):
            outs.append(s.gen(ids, N_NEW))
            assert outs[-1]["err"] is None, outs[-1]["err"]
        return outs, s.stats(), info
    finally:
        assert s.close() == 0


def _interleaved(system, starts):
    """A1 .. H1, then A2 .. H2, each follow-up its own conversation's prompt and reply and a new
    user turn."""
    def requests(outs):
        yield from starts
        for i, first in enumerate(starts):
            yield first + outs[i]["tokens"] + [5, 6, 7]
    return requests


def test_eight_interleaved_conversations_read_only_their_new_tokens(moe):
    rng = np.random.default_rng(0)
    system = _ids(rng, 20)
    starts = [system + _ids(rng, 15) for _ in range(8)]
    on, stats, info = _run(moe, "1", _interleaved(system, starts), "--layer-split", "2")
    off, _, _ = _run(moe, "0", _interleaved(system, starts), "--layer-split", "2")
    kept = len(starts[0]) + N_NEW - 1           # each first turn's prompt and reply, less the last
    # cache on: every follow-up resumes at its own conversation's end and reads the 4 new tokens
    assert [o["resume"] for o in on[8:]] == [kept] * 8
    assert [int(o["done"][1]) for o in on[8:]] == [4] * 8
    # cache off: only the previous request's state, so each follow-up shares just the system prompt
    assert [o["resume"] for o in off[8:]] == [len(system)] * 8
    # the same tokens either way
    assert [o["tokens"] for o in on] == [o["tokens"] for o in off]
    for rank in (0, 1):   # each stage restored its own part of every follow-up's conversation
        assert int(stats[rank]["conversations_restored"]) == 8
        assert int(stats[rank]["conversations_evicted"]) == 0
    # the carve each stage reports is what the plan priced
    for f in info[1:]:
        assert int(f["conversation_bytes"]) == int(f["conversation_priced_bytes"]) == MIB
        assert f["conversation_in"] == "device"


def test_eviction_at_a_small_budget_falls_back_to_a_full_read(tmp_path):
    # 2 KiB of K/V per cell on one stage (4 layers x 4 KV heads x 16 x f32 x K and V): 1 MiB
    # holds two 200-cell conversations. A1 B1 C1 D1 keep A, B, then C, which evicts A.
    path = write_moe_gguf(tiny_qwen3moe(3, hidden=128, top_k=2, n_layers=4), tmp_path / "kv.gguf",
                          "f32")
    rng = np.random.default_rng(1)
    starts = [_ids(rng, 197) for _ in range(4)]

    def requests(outs):
        yield from starts
        yield starts[0] + outs[0]["tokens"] + [5, 6, 7]   # A2: A was evicted
        yield starts[2] + outs[2]["tokens"] + [5, 6, 7]   # C2: C is kept

    def run(mib):
        s = ServeSession(path, "--cpu-ranks", "1", "--prefill", "256", "--max-context", "512",
                         "--vram-budget", "1G", "--conversation-cache-mib", mib)
        try:
            outs = []
            for ids in requests(outs):
                outs.append(s.gen(ids, N_NEW))
                assert outs[-1]["err"] is None, outs[-1]["err"]
            return outs, s.stats()
        finally:
            assert s.close() == 0

    on, stats = run("1")
    off, _ = run("0")
    kept = 197 + N_NEW - 1
    assert [o["resume"] for o in on[4:]] == [0, kept]     # A2 reads everything again
    assert [int(o["done"][1]) for o in on[4:]] == [204, 4]
    assert [o["tokens"] for o in on] == [o["tokens"] for o in off]
    assert int(stats[0]["conversations_evicted"]) >= 1


def test_qwen3next_restores_only_at_a_kept_length_or_checkpoint(hybrid):
    rng = np.random.default_rng(2)
    system = _ids(rng, 20)
    starts = [system + _ids(rng, 15) for _ in range(3)]

    def requests(outs):
        yield from _interleaved(system, starts)(outs)
        # diverging inside A1's kept conversation at 34: not at its length (38), but at the
        # checkpoint its first prompt left at 32 (every 16 tokens), kept with it
        yield starts[0][:34] + [9, 9, 9]
        # diverging at 10, before any checkpoint: read afresh
        yield starts[0][:10] + [9, 9, 9]

    args = ("--layer-split", "3", "--prompt-cache-every", "16")
    on, stats, _ = _run(hybrid, "1", requests, *args)
    off, _, _ = _run(hybrid, "0", requests, *args)
    kept = len(starts[0]) + N_NEW - 1
    assert [o["resume"] for o in on[3:]] == [kept] * 3 + [32, 0]
    # without: the serving session's checkpoints alone (the shared system prompt's 16 at best)
    assert all(o["resume"] <= 16 for o in off[3:])
    assert [o["tokens"] for o in on] == [o["tokens"] for o in off]
    for rank in (0, 1):
        assert int(stats[rank]["conversations_restored"]) == 4


def test_kept_conversations_are_reused_only_within_a_salt(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_synthetic(path, like="tiny", quant="f32", popularity="zipf:1.0")
    server = ServerProcess(str(path), "--cpu-ranks", "1", "--vram-budget", "1G", "--max-context",
                           "1024", "--conversation-cache-mib", "4", api_key="k-123")
    prompt = "the secret plan is to meet at the old mill at nine " * 3
    try:
        client = server.client()

        def cached(salt: str, text: str = prompt) -> int:
            r = client.completions.create(model="tiny", prompt=text, max_tokens=2, temperature=0,
                                          extra_body={"cache_salt": salt})
            return r.usage.prompt_tokens_details.cached_tokens

        assert cached("alice") == 0
        assert cached("bob") == 0           # alice's conversation, same prompt, is kept: not bob's
        assert cached("bob") > 0
        assert cached("alice") > 0          # restored from alice's kept conversation (bob's is live)
        assert cached("mallory", prompt[:40] + "guess") == 0
        r = client.completions.create(model="tiny", prompt="other text entirely", max_tokens=2,
                                      temperature=0, extra_body={"cache_salt": "carol"})
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        assert cached("bob") > 0            # bob's conversation was kept when carol's began
        # n choices on the prompt's cache: the prompt is read once, each later choice reads
        # only its last token again (each choice before it kept as a conversation)
        r = httpx.post(f"{server.url}/v1/completions", headers=server.headers, timeout=30,
                       json={"model": "tiny", "prompt": "a fresh prompt for three choices",
                             "max_tokens": 3, "temperature": 0, "n": 3, "cache_salt": "dave"})
        body = r.json()
        assert r.status_code == 200, body
        assert body["timings"]["prompt_read"] == body["usage"]["prompt_tokens"] + 2
        assert len({c["text"] for c in body["choices"]}) == 1     # greedy: the same three times
    finally:
        server.close()


def test_a_cancel_before_the_first_chunk_of_a_restoring_request_leaves_no_wrong_state(moe):
    """The ConversationStep rides on chunk 0: a request cancelled before any stage reported that
    chunk (here: before it was even sent) may have applied its restore on no stage, some, or all.
    The next request still reads the state its tokens say: its reply equals the one read with the
    same tokens before."""
    rng = np.random.default_rng(0)
    a_ids, b_ids = _ids(rng, 30), _ids(rng, 30)
    s = ServeSession(moe, "--cpu-ranks", "1", "--prefill", "16", "--max-context", str(CTX),
                     "--vram-budget", "1G", "--conversation-cache-mib", "1")
    try:
        a = s.gen(a_ids, N_NEW)["tokens"]
        follow_up = a_ids + a + [5, 6, 7]
        reference = s.gen(follow_up, 8)        # continues A: read on the state A left
        assert reference["err"] is None and reference["resume"] == len(a_ids) + N_NEW - 1
        assert s.gen(b_ids, N_NEW)["err"] is None   # the session now holds B; A's is kept
        # GEN and CANCEL in one write: the CANCEL is read at the first check, before chunk 0
        s.send(f"GEN 8 {' '.join(map(str, follow_up))}\nCANCEL")
        while not (line := s.next_line(30)).startswith(("DONE", "ERR")):
            pass
        assert line.startswith("DONE") and line.endswith("cancelled"), line
        again = s.gen(follow_up, 8)
        assert again["err"] is None
        assert again["tokens"] == reference["tokens"]
    finally:
        assert s.close() == 0


def test_qwen3next_kept_in_host_memory_restores_only_at_a_kept_length(hybrid):
    """Copies in pinned host memory keep no checkpoints: a follow-up that shares only a
    checkpoint's prefix with a kept conversation reads afresh (it does not ask a stage for a state
    it lacks), and one that extends the conversation resumes at its kept length."""
    rng = np.random.default_rng(4)
    a_ids, b_ids = _ids(rng, 50), _ids(rng, 50)
    s = ServeSession(hybrid, "--cpu-ranks", "2", "--prefill", "16", "--max-context", str(CTX),
                     "--vram-budget", "1G", "--conversation-cache-mib", "100000",
                     "--layer-split", "3", "--prompt-cache-every", "16")
    try:
        assert [f.get("conversation_in") for f in s.info_fields()[1:]] == ["host", "host"]
        a = s.gen(a_ids, N_NEW)
        assert s.gen(b_ids, N_NEW)["err"] is None
        branch = s.gen(a_ids[:40] + _ids(rng, 10), N_NEW)   # A's checkpoint at 32 is not kept
        assert branch["err"] is None and branch["resume"] == 0
        follow_up = s.gen(a_ids + a["tokens"] + [5, 6, 7], N_NEW)
        assert follow_up["err"] is None and follow_up["resume"] == len(a_ids) + N_NEW - 1
    finally:
        assert s.close() == 0


def test_negative_budget_is_refused(moe, capsys):
    assert launch_main(["--model", moe, "--conversation-cache-mib", "-1", "--plan-only"]) == 2
    assert "--conversation-cache-mib -1" in capsys.readouterr().err


# ---- in process ------------------------------------------------------------------------------------

def _stage(path, lb, le, budget, n_layers):
    return Stage(StageConfig(model_path=path, device="cpu", lb=lb, le=le, first=lb == 0,
                             last=le == n_layers, max_context=CTX, conversation_bytes=budget))


def _fill(stage, ids):
    s = stage.session(0)
    s.reset(0)
    stage.run(0, 0, ids=ids, prompt=True)
    return s


def test_a_stage_keeps_and_restores_its_own_layers(moe):
    stage = _stage(moe, 0, 2, 10 * MIB, 4)
    rng = np.random.default_rng(3)
    a = _fill(stage, _ids(rng, 30))
    want = [np.array(p[:30]) for p in kv_parts(a)]
    assert stage.conversations.keep(a, 1, 30)
    assert stage.conversations.nbytes == conversation_nbytes(a, 30) == sum(w.nbytes for w in want)
    _fill(stage, _ids(rng, 40))          # another conversation overwrites the session
    stage.conversations.restore(a, 1, 25)
    assert a.n_past == 25
    for got, w in zip(kv_parts(a), want):
        np.testing.assert_array_equal(got[:25], w[:25])
    with pytest.raises(ValueError, match="not kept"):
        stage.conversations.restore(a, 2, 5)


def test_least_recently_used_go_first_and_the_budget_holds(moe):
    probe = _stage(moe, 0, 4, 1, 4)
    per = conversation_nbytes(probe.session(0), 20)
    stage = _stage(moe, 0, 4, 2 * per + per // 2, 4)   # room for two
    cache, rng = stage.conversations, np.random.default_rng(4)
    for key in (1, 2):
        assert cache.keep(_fill(stage, _ids(rng, 20)), key, 20)
    cache.restore(stage.session(0), 1, 20)               # 1 is now the most recently used
    assert cache.keep(_fill(stage, _ids(rng, 20)), 3, 20)
    assert cache.keys() == [1, 3] and cache.nbytes <= cache.budget_bytes
    # the one about to be restored is never the one evicted to make room
    assert cache.keep(_fill(stage, _ids(rng, 20)), 4, 20, protect=1)
    assert cache.keys() == [1, 4]
    assert not cache.keep(stage.session(0), 5, 60)       # larger than the budget: not kept
    assert cache.counters["conversations_skipped"] == 1


def test_recurrent_state_is_restored_only_at_its_kept_length(hybrid):
    stage = _stage(hybrid, 0, 4, 10 * MIB, 8)
    rng = np.random.default_rng(5)
    s = _fill(stage, _ids(rng, 24))
    conv = {l: np.array(s.conv_state(l)) for l in s.linear_layers}
    assert not stage.conversations.keep(s, 1, 20)        # the state is at 24, not 20
    assert stage.conversations.keep(s, 1, 24)
    _fill(stage, _ids(rng, 30))
    with pytest.raises(ValueError, match="valid only there and at \\[\\]"):
        stage.conversations.restore(s, 1, 20)
    stage.conversations.restore(s, 1, 24)
    for l in s.linear_layers:
        np.testing.assert_array_equal(s.conv_state(l), conv[l])


def test_the_head_table_picks_the_longest_prefix_of_its_salt():
    t = ConversationTable(True)
    step = t.step([1, 2, 3, 4], "a", "a", 0, (0, 0), positional=True)
    assert (step.keep, step.keep_n) == (1, 4)
    t.reported([1])
    assert t.step([1, 2, 9], "b", "a", 3, (0, 0), positional=True).keep == 2
    t.reported([1, 2])
    # a request that continues the serving session keeps nothing
    assert t.step([1, 2, 9], "b", "b", 3, (0, 0), positional=True) is None
    assert t.best([1, 2, 3, 7, 8], "a", positional=True) == (1, 3)
    assert t.best([1, 2, 3, 7, 8], "b", positional=True) == (2, 2)
    assert t.best([1, 2, 3, 7, 8], "c", positional=True) == (0, 0)
    # recurrent state: a kept conversation serves only at its length or a checkpoint kept with it
    r = ConversationTable(True)
    r.step([1, 2, 3, 4, 5], "a", "a", 0, (0, 0), positional=False, live_checkpoints=[2, 9])
    assert r.kept[1].positions == [2, 5]
    assert r.best([1, 2, 3, 4, 5, 6], "a", positional=False) == (1, 5)
    assert r.best([1, 2, 3, 4, 9], "a", positional=False) == (1, 2)
    assert r.best([1, 7], "a", positional=False) == (0, 0)
    # stages that keep in host memory keep no checkpoints: only the kept length restores
    h = ConversationTable(True, checkpoints_kept=False)
    h.step([1, 2, 3, 4, 5], "a", "a", 0, (0, 0), positional=False, live_checkpoints=[2])
    assert h.kept[1].positions == [5] and h.best([1, 2, 3, 4, 9], "a", positional=False) == (0, 0)
    # a key sent to keep and never reported is no conversation: dropped on every stage next time
    step = r.step([1, 2, 8], "a", "b", 0, (0, 0), positional=False)
    r.begin()
    assert 2 not in r.kept
    assert r.step([], "b", "b", 0, (0, 0), positional=False).forget == [step.keep]
    # a restore that failed before anything was read: dropped too
    r.discard(1)
    assert r.kept == {} and r.step([], "b", "b", 0, (0, 0), positional=False).forget == [1]
    # a step no stage reported after (its request cancelled before chunk 0 came back): its
    # forgets may not have reached every stage, so they go again, and its new key is dropped
    u = ConversationTable(True)
    u.step([1, 2], "a", "a", 0, (0, 0), positional=True)
    u.reported([1])
    step = u.step([1, 2, 3], "a", "a", 0, (0, 0), positional=True)   # supersedes 1
    assert step.forget == [1] and 1 not in u.kept
    u.unconfirmed(step)
    u.begin()
    assert u.step([], "a", "a", 0, (0, 0), positional=True).forget == [1, step.keep]


# ---- the planner ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kinds", [None, "hybrid"])
def test_the_plan_prices_the_cache_on_every_stage_before_its_expert_cache(kinds):
    shape = make_shape(8, kinds=hybrid_kinds(8) if kinds else None)
    devs = make_devices([400, 400])
    base = make_plan(shape, devs, cells=512, split=[4])
    plan = make_plan(shape, devs, cells=512, split=[4], conversation_bytes=64 * MIB)
    for before, after in zip(base.stages, plan.stages):
        assert after.conversation_bytes == 64 * MIB and after.conversation_in == "device"
        # (the prompt chunk, and with it the hand-off rows in the reserve, may shrink too)
        assert (after.budget_bytes + after.reserve_bytes
                == before.budget_bytes + before.reserve_bytes - 64 * MIB)
        assert after.cache_bytes <= after.budget_bytes
        assert plan.left_bytes(after.device) >= 0
    assert plan.expert_slots_stages < base.expert_slots_stages
    assert Plan.from_json(plan.to_json()) == plan     # what the ranks receive keeps the price


def test_cards_without_room_keep_it_in_pinned_host_memory():
    shape = make_shape(8)
    tight = make_plan(shape, make_devices([400, 400]), cells=512, split=[4])
    room = min(st.budget_bytes for st in tight.stages)
    plan = make_plan(shape, make_devices([400, 400]), cells=512, split=[4],
                     conversation_bytes=room + MIB)
    assert all(st.conversation_in == "host" for st in plan.stages)
    assert any("pinned host memory" in n for n in plan.notes)
    with pytest.raises(PlanError):
        make_plan(shape, make_devices([400, 400]), cells=512, conversation_bytes=-1)


def test_qwen3next_speculation_keeps_each_conversation_at_its_accepted_tokens(hybrid):
    """Kept conversations and verify windows together (a qwen3next stage rolls its recurrent
    state back inside a window; a conversation is kept only at its exact length): every
    follow-up resumes from its kept conversation and its tokens equal a run without speculation."""
    rng = np.random.default_rng(4)
    system = _ids(rng, 20)
    # prompts that repeat themselves, so the n-gram drafter drafts (and the random model rejects)
    starts = [system + (_ids(rng, 5) * 4) for _ in range(3)]

    def run(*spec):
        s = ServeSession(hybrid, "--cpu-ranks", "2", "--prefill", "16", "--max-context", str(CTX),
                         "--vram-budget", "1G", "--conversation-cache-mib", "1",
                         "--layer-split", "3", "--prompt-cache-every", "16", *spec)
        try:
            outs = []
            for ids in _interleaved(system, starts)(outs):
                outs.append(s.gen(ids, 40))
                assert outs[-1]["err"] is None, outs[-1]["err"]
            return outs, s.stats()
        finally:
            assert s.close() == 0

    spec, stats = run("--spec", "4")
    plain, _ = run()
    assert [o["tokens"] for o in spec] == [o["tokens"] for o in plain]
    last = stats[max(stats)]
    assert int(last["spec_drafted"]) > int(last["spec_accepted"]) > 0   # drafts both ways
    assert int(stats[0]["conversations_restored"]) == 3
    assert int(stats[0]["conversations_skipped"]) == 0


def test_qwen3next_request_stopping_inside_a_verify_window_is_kept(tmp_path):
    """A stop token before a verify window's last row leaves a qwen3next stage's recurrent state
    past the request's tokens; the stage rolls it back before keeping the conversation, so the
    follow-up resumes from it (not from scratch) with the tokens of a run without speculation."""
    rng = np.random.default_rng(4)
    system = _ids(rng, 20)
    a, b = system + _ids(rng, 5) * 4, system + _ids(rng, 5) * 4
    # token 84 is one this random model emits a few tokens in, inside a window that was drafted
    model = write_next_gguf(tiny_qwen3next(4, hidden=64, top_k=2), tmp_path / "eos.gguf", "f32",
                            eos_id=84)

    def run(*spec):
        s = ServeSession(model, "--cpu-ranks", "2", "--prefill", "16", "--max-context", str(CTX),
                         "--vram-budget", "1G", "--conversation-cache-mib", "1",
                         "--layer-split", "3", "--prompt-cache-every", "16", *spec)
        try:
            first = s.gen(a, 40)
            s.gen(b, 40)
            follow = s.gen(a + first["tokens"] + [5, 6, 7], 4)
            return first, follow, s.stats()
        finally:
            assert s.close() == 0

    first, follow, stats = run("--spec", "4")
    plain_first, plain_follow, _ = run()
    assert first["done"][-1] == "stop" and len(first["tokens"]) < 40   # it stopped early
    assert int(stats[max(stats)]["spec_drafted"]) > 0
    assert (first["tokens"], follow["tokens"]) == (plain_first["tokens"], plain_follow["tokens"])
    assert follow["resume"] == plain_follow["resume"] == len(a) + len(first["tokens"]) - 1
    assert all(int(f["conversations_skipped"]) == 0 for f in stats.values())
