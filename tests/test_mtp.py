"""qwen3next files with a multi-token-prediction block, and `--spec K --draft mtp`
(strata_dist/sampling/mtp_draft.py).

- a tiny-next file written with the block (synth --mtp, llama.cpp's converter layout) runs its
  stack exactly as the same file without it: tokens of one process and of two CPU ranks, and the
  plan's prices, are those of the file without the block;
- the block's forward (one step over a prompt's positions, and a chained second step) equals the
  summary's math written here in plain numpy over the tensors gguf-py reads;
- greedy tokens of real launches with --spec 4 --draft mtp equal --spec 0's, 1 and 2 stages, the
  drafts reported in the usage and STATS;
- the block is priced on the last stage as carved, shown by --plan-only; files without a block,
  qwen3moe files and a recurrent_layers key that contradicts the stack are refused naming them."""
import json
import subprocess
import sys

import gguf
import numpy as np
import pytest

from launch_helpers import ServeSession
from strata_dist.sampling.mtp_draft import MtpDrafter, MtpSession, plan_bytes
from strata_dist.models import architecture_for, open_checked
from strata_dist.tools.single_process import SingleProcessRunner
from strata_dist.rank.stage import Stage, StageConfig
from strata_dist.synth import write_synthetic

CTX = 256
PROMPT = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7, 8]
MIB = 1 << 20


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("mtp")
    out = {}
    for name, mtp in (("plain", False), ("mtp", True)):
        out[name] = str(d / f"{name}.gguf")
        write_synthetic(out[name], like="tiny-next", quant="f32", seed=3, mtp=mtp)
    out["moe"] = str(d / "moe.gguf")
    write_synthetic(out["moe"], like="tiny", quant="f32")
    return out


def _launch(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


# ---- the file and its stack ----------------------------------------------------------------------

def test_the_block_is_laid_out_as_the_converter_writes_it(files):
    r = gguf.GGUFReader(files["mtp"])
    field = lambda k: r.fields[k].contents()   # noqa: E731
    assert field("qwen3next.block_count") == 9 and field("qwen3next.nextn_predict_layers") == 1
    assert field("qwen3next.attention.recurrent_layers") == [True, True, True, False] * 2 + [False]
    names = {t.name: tuple(int(x) for x in t.shape) for t in r.tensors}
    assert names["blk.8.nextn.eh_proj.weight"] == (128, 64)     # ggml order: [2 n_embd, n_embd]
    for part in ("nextn.enorm", "nextn.hnorm", "nextn.shared_head_norm", "attn_q", "attn_k_norm",
                 "ffn_gate_inp", "ffn_down_exps", "ffn_up_shexp"):
        assert f"blk.8.{part}.weight" in names
    g = architecture_for(open_checked(files["mtp"])).read_geometry(open_checked(files["mtp"]))
    assert (g.n_layers, g.n_nextn) == (8, 1)


def test_the_stack_runs_as_the_file_without_the_block(files):
    want = SingleProcessRunner(files["plain"], prompt_chunk=16,
                               max_context=CTX).generate(PROMPT, 16).tokens
    got = SingleProcessRunner(files["mtp"], prompt_chunk=16,
                              max_context=CTX).generate(PROMPT, 16).tokens
    assert list(got) == list(want)
    s = ServeSession(files["mtp"], "--cpu-ranks", "2", "--layer-split", "4", "--prefill", "16",
                     "--max-context", str(CTX), "--vram-budget", "1G", "--gpu-order", "as_given")
    try:
        out = s.gen(PROMPT, 16)
        assert out["err"] is None and out["tokens"] == list(want)
    finally:
        assert s.close() == 0


def test_plan_only_prices_the_stack_alone_without_draft_mtp(files):
    base = ["--cpu-ranks", "2", "--layer-split", "4", "--max-context", str(CTX),
            "--vram-budget", "1G", "--plan-only", "--json"]
    plain = json.loads(_launch("--model", files["plain"], *base).stdout)
    with_block = json.loads(_launch("--model", files["mtp"], *base).stdout)
    assert plain["stages"] == with_block["stages"] and plain["params"] == with_block["params"]


# ---- the block's forward against the summary's math ---------------------------------------------

def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, pos, n_rot, base):
    """NEOX rotation of the first n_rot dims of each head of x [heads, dim] at `pos`."""
    half = n_rot // 2
    ang = pos * base ** (-np.arange(half) * 2.0 / n_rot)
    out = x.copy()
    a, b = x[:, :half], x[:, half:n_rot]
    out[:, :half] = a * np.cos(ang) - b * np.sin(ang)
    out[:, half:n_rot] = b * np.cos(ang) + a * np.sin(ang)
    return out


def _silu(x):
    return x / (1 + np.exp(-x))


class Reference:
    """The MTP step as the task's summary says it, in float64 over gguf-py's tensors."""

    def __init__(self, path):
        r = gguf.GGUFReader(path)
        self.t = {t.name: np.array(t.data, dtype=np.float64) for t in r.tensors}
        f = lambda k: r.fields[f"qwen3next.{k}"].contents()   # noqa: E731
        self.L, self.eps = f("block_count") - 1, f("attention.layer_norm_rms_epsilon")
        self.heads, self.kv_heads, self.hd = (f("attention.head_count"),
                                              f("attention.head_count_kv"), f("attention.key_length"))
        self.n_rot, self.base, self.top_k = (f("rope.dimension_count"), f("rope.freq_base"),
                                             f("expert_used_count"))
        self.keys, self.values = [], []

    def w(self, part):
        return self.t[f"blk.{self.L}.{part}.weight"]

    def step(self, token, h_prev, pos):
        t, eps, H, hd = self.t, self.eps, self.heads, self.hd
        e = t["token_embd.weight"][token]
        x = self.w("nextn.eh_proj") @ np.concatenate([_rms(e, self.w("nextn.enorm"), eps),
                                                      _rms(h_prev, self.w("nextn.hnorm"), eps)])
        a = _rms(x, self.w("attn_norm"), eps)
        qg = (self.w("attn_q") @ a).reshape(H, 2 * hd)
        q, gate = qg[:, :hd], qg[:, hd:]
        k = (self.w("attn_k") @ a).reshape(self.kv_heads, hd)
        v = (self.w("attn_v") @ a).reshape(self.kv_heads, hd)
        q = _rope(_rms(q, self.w("attn_q_norm"), eps), pos, self.n_rot, self.base)
        k = _rope(_rms(k, self.w("attn_k_norm"), eps), pos, self.n_rot, self.base)
        del self.keys[pos:], self.values[pos:]
        self.keys.append(k)
        self.values.append(v)
        K, V = np.stack(self.keys), np.stack(self.values)      # [pos + 1, kv_heads, hd]
        attn = np.empty((H, hd))
        for head in range(H):
            kv = head // (H // self.kv_heads)
            s = K[:, kv] @ q[head] / np.sqrt(hd)
            p = np.exp(s - s.max())
            attn[head] = (p / p.sum()) @ V[:, kv]
        x = x + self.w("attn_output") @ (attn * (1 / (1 + np.exp(-gate)))).reshape(-1)
        m = _rms(x, self.w("post_attention_norm"), eps)
        logits = self.w("ffn_gate_inp") @ m
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = np.argsort(-p)[:self.top_k]
        wts = p[top] / p[top].sum()
        moe = sum(wt * (self.w("ffn_down_exps")[e_] @ (_silu(self.w("ffn_gate_exps")[e_] @ m)
                                                        * (self.w("ffn_up_exps")[e_] @ m)))
                  for e_, wt in zip(top, wts))
        shared = self.w("ffn_down_shexp") @ (_silu(self.w("ffn_gate_shexp") @ m)
                                             * (self.w("ffn_up_shexp") @ m))
        gate_shared = 1 / (1 + np.exp(-(self.w("ffn_gate_inp_shexp").reshape(-1) @ m)))
        x = x + moe + gate_shared * shared
        normed = _rms(x, self.w("nextn.shared_head_norm"), eps)
        return t["output.weight"] @ normed, normed


def test_the_block_steps_as_the_summary_says(files):
    path = files["mtp"]
    stage = Stage(StageConfig(path, "cpu", 0, 8, True, True, CTX))
    drafter = MtpDrafter(path, "cpu", CTX, stage.model)
    rows = {}
    stage.hidden_sink = lambda sid, pos, h: rows.update({pos: np.array(h)})
    stage.run(0, 0, ids=PROMPT, prompt=True)
    ref = Reference(path)
    out_norm = ref.t["output_norm.weight"]
    final = _rms(rows[0].astype(np.float64), out_norm, ref.eps)     # the rows the head reads
    n = len(PROMPT)
    # positions 0..n-1: token q with the row of q - 1 (a zero row before position 0)
    h_before = np.vstack([np.zeros((1, final.shape[1])), final[:-1]])
    session = MtpSession(drafter.backend, drafter.block.g, CTX)
    logits, normed = drafter.block.step(PROMPT, h_before.astype(np.float32), session, 0)
    for q in range(n):
        want, want_normed = ref.step(PROMPT[q], h_before[q], q)
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.asarray(logits)[0], want, rtol=0, atol=2e-4 * scale)
    # the chained step: the draft as token at position n, the block's own row as h
    draft = int(np.argmax(want))
    logits2, _ = drafter.block.step([draft], normed, session, n)
    want2, _ = ref.step(draft, want_normed, n)
    np.testing.assert_allclose(np.asarray(logits2)[0], want2, rtol=0,
                               atol=2e-4 * np.abs(want2).max())
    # the drafter's own first drafts are these steps' argmaxes
    drafter.take_hidden(0, 0, rows[0])
    drafts, qs = drafter.draft(0, PROMPT, 2, 0.0)
    assert drafts == [draft, int(np.argmax(want2))] and qs == [None, None]


# ---- --draft mtp through real launches -----------------------------------------------------------

@pytest.mark.parametrize("split", ["", "4"])
def test_greedy_tokens_equal_with_draft_mtp(files, split):
    want = SingleProcessRunner(files["plain"], prompt_chunk=16,
                               max_context=CTX).generate(PROMPT, 24).tokens
    args = ["--cpu-ranks", "2" if split else "1", "--prefill", "16", "--max-context", str(CTX),
            "--vram-budget", "1G", "--gpu-order", "as_given", "--spec", "4", "--draft", "mtp"]
    s = ServeSession(files["mtp"], *args, *(["--layer-split", split] if split else []))
    try:
        out = s.gen(PROMPT, 24)
        assert out["err"] is None, out["err"]
        assert out["tokens"] == list(want)
        drafted, accepted = int(out["stats"][-1]["drafted"]), int(out["stats"][-1]["accepted"])
        assert drafted > 20          # random weights: acceptance is whatever it is, and reported
        last = s.stats()[max(s.stats())]
        assert (int(last["spec_drafted"]), int(last["spec_accepted"])) == (drafted, accepted)
        # a second turn that rewrites the conversation's end: the block's KV follows it
        follow = PROMPT + out["tokens"][:5] + [7, 8, 9]
        again = s.gen(follow, 8)
        assert again["err"] is None and again["tokens"] == list(
            SingleProcessRunner(files["plain"], prompt_chunk=16,
                                max_context=CTX).generate(follow, 8).tokens)
    finally:
        assert s.close() == 0


# ---- priced on the last stage --------------------------------------------------------------------

def test_the_block_is_priced_on_the_last_stage_as_carved(files):
    path = files["mtp"]
    base = ["--model", path, "--cpu-ranks", "2", "--layer-split", "4", "--max-context",
            str(CTX), "--vram-budget", "1G", "--plan-only", "--spec", "4"]
    plain = json.loads(_launch(*base, "--json").stdout)
    r = _launch(*base, "--json", "--draft", "mtp")
    assert r.returncode == 0, r.stderr
    priced = json.loads(r.stdout)
    want = plan_bytes(path, "cpu", None, CTX)
    assert priced["params"]["draft_bytes"] == want > 0
    reserve = [(a["reserve_bytes"], b["reserve_bytes"])
               for a, b in zip(plain["stages"], priced["stages"])]
    assert reserve[0][0] == reserve[0][1] and reserve[1][1] - reserve[1][0] == want
    assert f"MTP block (--draft mtp): {want / MIB:.1f} MiB" in _launch(*base, "--draft", "mtp").stdout
    # what the drafter carves: the priced bytes less the catch-up call's buffers (a reserve)
    stage = Stage(StageConfig(path, "cpu", 4, 8, False, True, CTX))
    drafter = MtpDrafter(path, "cpu", CTX, stage.model)
    from strata_dist.models.shape import model_shape
    from strata_dist.sampling.mtp_draft import CATCH_UP_ROWS
    work = model_shape(open_checked(path), "cpu", None).prompt_bytes(CATCH_UP_ROWS)
    assert drafter.weights_bytes + drafter.session_bytes() == want - work


def test_an_inventory_of_both_kinds_reserves_the_blocks_larger_price(files, tmp_path):
    """A GPU and a CPU rank may each run the last stage: the block is reserved at the larger of
    its two prices, a CPU rank's here (its dense tensors f32, its K/V f32, its experts copied as
    on a GPU), so it fits the stage wherever that lands."""
    path = files["mtp"]
    rig = tmp_path / "rig.json"
    rig.write_text(json.dumps([{"name": f"{kind}{i}", "total_mib": 8000, "free_mib": 7000,
                                "index": i, "kind": kind}
                               for i, kind in enumerate(("cuda", "cpu"))]))
    base = ["--model", path, "--inventory", str(rig), "--layer-split", "4", "--max-context",
            str(CTX), "--plan-only", "--spec", "4", "--json"]
    plain, priced = json.loads(_launch(*base).stdout), json.loads(_launch(*base, "--draft",
                                                                          "mtp").stdout)
    on_cpu, on_gpu = plan_bytes(path, "cpu", None, CTX), plan_bytes(path, "cuda", None, CTX)
    assert on_cpu > on_gpu
    assert priced["params"]["draft_bytes"] == on_cpu
    last = [(a["reserve_bytes"], b["reserve_bytes"])
            for a, b in zip(plain["stages"], priced["stages"])][-1]
    assert last[1] - last[0] == on_cpu


def test_plan_only_prices_the_blocks_drafting_in_the_tok_s_prediction(files):
    """--draft mtp's K drafts are K one-row steps of the block on the last stage's device: its
    tensors (less the embedding, read a row at a time), the model's head (the file has no
    shared_head_head), top_k of its experts and its K/V half filled, read once a step."""
    path = files["mtp"]
    base = ["--model", path, "--cpu-ranks", "2", "--layer-split", "4", "--max-context",
            str(CTX), "--vram-budget", "1G", "--plan-only", "--spec", "4", "--json"]
    r = _launch(*base, "--draft", "mtp")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    spec, params = got["speculation"], got["params"]
    reader = gguf.GGUFReader(path)
    meta = lambda k: int(reader.fields[f"qwen3next.{k}"].parts[-1][0])   # noqa: E731
    L, top_k = meta("block_count") - 1, meta("expert_used_count")
    block = {t.name: int(t.n_bytes) for t in reader.tensors if t.name.startswith(f"blk.{L}.")}
    assert f"blk.{L}.nextn.shared_head_head.weight" not in block
    head = next(int(t.n_bytes) for t in reader.tensors
                if t.name == ("output.weight" if any(t.name == "output.weight"
                                                    for t in reader.tensors)
                              else "token_embd.weight"))
    experts = sum(n for name, n in block.items() if "_exps." in name)
    dense = sum(n for name, n in block.items()
                if "_exps." not in name and "embed_tokens" not in name)
    n_expert = meta("expert_count")
    head_dim, n_kv = meta("attention.key_length"), meta("attention.head_count_kv")
    kv = 2 * n_kv * head_dim * 4 * CTX * params["kv_fill"]          # f32 K and V on a CPU rank
    step = dense + head + top_k * experts / n_expert + kv
    bw = got["devices"][-1]["mem_bandwidth_gbs"] * 1e6                 # bytes a millisecond
    assert spec["drafter"] == "mtp"
    assert spec["drafter_ms"] == pytest.approx(4 * (step / bw + params["layer_ms"]), rel=1e-3)
    ngram = json.loads(_launch(*base).stdout)["speculation"]
    assert spec["tok_s"]["0.9"] < ngram["tok_s"]["0.9"]     # the block's drafting costs time


# ---- refusals ------------------------------------------------------------------------------------

def _flip_first_recurrent_flag(src: str, dst: str) -> None:
    data = bytearray(open(src, "rb").read())
    key = b"qwen3next.attention.recurrent_layers"
    at = data.index(key) + len(key) + 4 + 4 + 8     # value type, element type, count
    data[at] ^= 1
    open(dst, "wb").write(bytes(data))


@pytest.mark.parametrize("case", ["no block", "qwen3moe", "spec 0", "recurrent_layers"])
def test_files_and_flags_mtp_cannot_run_are_refused_at_start(files, tmp_path, case):
    model, flags = files["mtp"], ["--spec", "4", "--draft", "mtp"]
    if case == "no block":
        model, said = files["plain"], [files["plain"], "'qwen3next.nextn_predict_layers'"]
    elif case == "qwen3moe":
        model, said = files["moe"], [files["moe"], "qwen3moe model"]
    elif case == "spec 0":
        flags, said = ["--draft", "mtp"], ["--draft mtp with --spec 0"]
    else:
        model = str(tmp_path / "flipped.gguf")
        _flip_first_recurrent_flag(files["mtp"], model)
        flags, said = [], [model, "'qwen3next.attention.recurrent_layers'", "block 0"]
    r = _launch("--model", model, "--cpu-ranks", "1", "--serve", *flags)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for s in said:
        assert s in lines[0], lines[0]


def test_a_qwen3moe_file_with_nextn_layers_runs_its_stack_and_says_once(tmp_path, monkeypatch,
                                                                       caplog):
    """Its last block is taken as the unused MTP block: the tokens are those of the same file
    written without that block, and the block is said unused once."""
    from dataclasses import replace

    from strata_dist.synth import GEOMETRIES
    short = replace(GEOMETRIES["tiny"], n_layer=GEOMETRIES["tiny"].n_layer - 1)
    write_synthetic(tmp_path / "short.gguf", like=short, quant="f32")
    add_block_count = gguf.GGUFWriter.add_block_count

    def with_nextn(writer, n):       # the converter's key, on a qwen3moe file
        add_block_count(writer, n)
        writer.add_nextn_predict_layers(1)
    monkeypatch.setattr(gguf.GGUFWriter, "add_block_count", with_nextn)
    write_synthetic(tmp_path / "nextn.gguf", like="tiny", quant="f32")
    monkeypatch.undo()
    with caplog.at_level("WARNING", logger="strata.models"):
        got = SingleProcessRunner(str(tmp_path / "nextn.gguf"), max_context=CTX)
        tokens = got.generate(PROMPT, 8).tokens
        SingleProcessRunner(str(tmp_path / "nextn.gguf"), max_context=CTX)
    assert got.model.g.n_layers == short.n_layer
    assert list(tokens) == list(SingleProcessRunner(str(tmp_path / "short.gguf"),
                                                    max_context=CTX).generate(PROMPT, 8).tokens)
    said = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(said) == 1 and "unused" in said[0] and f"blk.{short.n_layer}" in said[0]


def test_a_session_keeps_the_latest_rows_in_order(files, monkeypatch):
    """The rows a session keeps before its next draft: continued, their tail overwritten by a
    window that starts inside them, the oldest dropped past PENDING_ROWS, a zero row for each
    position it lacks."""
    import strata_dist.sampling.mtp_draft as mtp_draft
    from strata_dist.backends import get_backend
    monkeypatch.setattr(mtp_draft, "PENDING_ROWS", 5)
    gguf_file = open_checked(files["mtp"])
    s = MtpSession(get_backend("cpu"), architecture_for(gguf_file).read_geometry(gguf_file), 64)

    def rows(a, b):
        return np.repeat(np.arange(a, b, dtype=np.float32)[:, None], 64, axis=1)

    def kept():
        return s.pending_start, s.pending[:s.pending_n, 0].tolist()
    s.keep(0, rows(0, 3))
    s.keep(3, rows(3, 4))
    assert kept() == (0, [0, 1, 2, 3])
    s.keep(4, rows(4, 7))                  # past 5 rows: the oldest go
    assert kept() == (2, [2, 3, 4, 5, 6])
    s.keep(5, rows(105, 106))              # a window from position 5: the tail replaced
    assert kept() == (2, [2, 3, 4, 105])
    s.keep(20, rows(20, 30))               # elsewhere: only the latest 5 of these
    assert kept() == (25, [25, 26, 27, 28, 29])
    assert s.rows_before(24, 28)[:, 0].tolist() == [0, 0, 25, 26]
    s.forget_before(27)
    assert kept() == (27, [27, 28, 29])


def test_drafts_are_those_of_llama_cpps_mtp(tmp_path):
    """Recorded from llama.cpp (llama-speculative-simple -m F --spec-type draft-mtp -p "hello
    world" -n 16 --temp 0 --spec-draft-n-max 4 -lv 5, its "draft candidate 0" lines) on F =
    `strata-dist synth F --like tiny-next --quant f32 --mtp` (seed 0): with the prompt's last token
    kept apart it drafts 392 112 497 177 at positions 6..9, draws 114, then after 114 and 238
    drafts 20 484 293 341."""
    path = str(tmp_path / "mtp.gguf")
    write_synthetic(path, like="tiny-next", quant="f32", mtp=True)
    prompt = [257, 298, 78, 265, 272, 337]          # "hello world" in the file's tokenizer
    stage = Stage(StageConfig(path, "cpu", 0, 8, True, True, CTX))
    drafter = MtpDrafter(path, "cpu", CTX, stage.model)
    stage.hidden_sink = drafter.take_hidden
    stage.run(0, 0, ids=prompt[:-1], prompt=True)
    first = drafter.draft(0, prompt, 4, 0.0)[0]
    assert first == [392, 112, 497, 177]
    window = stage.run(0, 5, ids=[prompt[-1]] + first, all_rows=True)
    assert int(np.argmax(window[0])) == 114           # no draft accepted: the window ends here
    assert int(np.argmax(stage.run(0, 6, ids=[114]))) == 238
    assert drafter.draft(0, prompt + [114, 238], 4, 0.0)[0] == [20, 484, 293, 341]


def test_rows_of_another_conversation_read_as_zero_rows(files):
    """A kept conversation restored into a session (--conversation-cache-mib) leaves the rows the
    session kept for the conversation before it at the positions the restore skips: computed from
    other tokens, the block reads them as zero rows (as a position never computed), and reads the
    rows of the positions both conversations share, and the new rows, as they were kept."""
    path = files["mtp"]
    stage = Stage(StageConfig(path, "cpu", 4, 8, False, True, CTX))
    drafter = MtpDrafter(path, "cpu", CTX, stage.model)
    read = []
    step = drafter.block.step

    def reading(token_ids, hidden, session, pos0):     # the real step, its rows recorded
        read.append((pos0, np.array(hidden, dtype=np.float32)))
        return step(token_ids, hidden, session, pos0)
    drafter.block.step = reading
    rng = np.random.default_rng(7)
    n_embd = drafter.block.g.n_embd
    a = [5, 6, 7, 8, 9, 10, 11, 12]
    rows_a = rng.standard_normal((len(a), n_embd)).astype(np.float32)
    drafter.take_hidden(0, 0, rows_a)
    drafter.draft(0, a, 2, 0.0)
    # conversation b shares a's first 3 tokens; its first 8 are restored, positions 8, 9 read
    b = [5, 6, 7, 20, 21, 22, 23, 24, 25, 26]
    rows_b = rng.standard_normal((2, n_embd)).astype(np.float32)
    drafter.take_hidden(0, 8, rows_b)
    read.clear()
    drafter.draft(0, b, 2, 0.0)
    pos0, hidden = read[0]            # the catch-up: positions 3..9 read rows 2..8

    def normed(row):                  # the stack's output norm, as the head reads the row
        w = next(np.asarray(t.data, dtype=np.float64) for t in gguf.GGUFReader(path).tensors
                 if t.name == "output_norm.weight")
        x = row.astype(np.float64)
        return x / np.sqrt(np.mean(x * x) + drafter.block.g.rms_eps) * w
    assert pos0 == 3 and len(hidden) == 7
    by_pos = {p: hidden[p - 2] for p in range(2, 9)}
    assert not np.any(by_pos[7])            # a's row 7, kept before the restore: zero
    assert np.allclose(by_pos[8], normed(rows_b[0]), rtol=1e-4, atol=1e-5)


def test_the_pending_rows_are_priced_only_where_the_host_is_the_device(files, monkeypatch):
    """A session's pending hidden rows are host memory: a CPU rank's price holds them (n_embd
    float32 a row), a GPU's reserve does not."""
    import strata_dist.sampling.mtp_draft as mtp_draft
    path = files["mtp"]
    n_embd = int(gguf.GGUFReader(path).fields["qwen3next.embedding_length"].parts[-1][0])
    before = {kind: plan_bytes(path, kind, None, CTX) for kind in ("cpu", "cuda")}
    monkeypatch.setattr(mtp_draft, "PENDING_ROWS", mtp_draft.PENDING_ROWS + 100)
    after = {kind: plan_bytes(path, kind, None, CTX) for kind in ("cpu", "cuda")}
    assert after["cpu"] - before["cpu"] == 100 * n_embd * 4
    assert after["cuda"] == before["cuda"]
