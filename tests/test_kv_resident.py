"""--kv-resident N: a session keeps N cells of each K/V on the device (the attention sinks and a
ring of the newest) and every cell in a host copy (strata_dist/backends/kv_cache.py RingKV). The
index rule reads each cell from where it must be; greedy tokens and logits equal those with every
cell resident, on both architectures, in one process and on two CPU ranks, past several ring
wraps, after a resumed prefix and after rejected drafts; the sessions carve what the plan prices
(device part, host part); bad values are refused at start with one line."""
import json
import subprocess
import sys

import numpy as np
import pytest

from hf_fixtures import tiny_qwen3moe, write_gguf
from hf_next_fixtures import tiny_qwen3next, write_gguf as write_next_gguf
from launch_helpers import ServeSession
from strata_dist.backends.kv_cache import RingKV, new_kv
from strata_dist.gguf_file.reader import GGUFModel
from strata_dist.models.shape import model_shape
from strata_dist.plan.pricing import KV_SINK_CELLS, session_bytes, session_host_bytes, session_parts
from strata_dist.tools.single_process import SingleProcessRunner
from strata_dist.rank.stage import Stage, StageConfig

CELLS = 128
CHUNK = 8
RESIDENT = KV_SINK_CELLS + 9          # a ring of 9: a chunk of 8 fits, and the ring wraps often
PROMPT = [5, 17, 3, 250, 99, 4, 180, 61, 7, 42, 11, 12, 13, 14, 200, 201, 31, 77, 8, 9, 10, 150,
          151, 152, 153, 40, 41, 42, 43, 44, 45, 46, 90, 91, 92]            # 35 tokens > the ring


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """head_dim 32 (q8_0 blocks whole): qwen3moe and qwen3next (K/V only in its attention layers)."""
    folder = tmp_path_factory.mktemp("kvres")
    return {"qwen3moe": str(write_gguf(tiny_qwen3moe(21, head_dim=32), folder / "m.gguf")),
            "qwen3next": str(write_next_gguf(tiny_qwen3next(22), folder / "n.gguf"))}


# ---- the store's index rule -----------------------------------------------------------------------

@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
def test_reads_take_sinks_and_newest_from_the_device_and_the_rest_from_the_host(kv_type):
    rng = np.random.default_rng(0)
    rows = RingKV(np, (40, 2, 32), kv_type, sinks=4, ring=6)
    x = rng.standard_normal((40, 2, 32)).astype(np.float32)
    for a, b in [(0, 5), (5, 6), (6, 12), (12, 13), (13, 21)]:       # prompt chunks, then steps
        rows[a:b] = x[a:b]
    plain = new_kv(np, (40, 2, 32), kv_type)
    plain[0:21] = x[0:21]
    assert np.array_equal(rows[0:21], np.asarray(plain[0:21]))
    # poison each copy where the rule must not read it: the reads do not move
    want = rows[0:21]
    card_cells = [0, 1, 2, 3, *range(15, 21)]            # sinks and the newest 6 (ring slots)
    host_cells = list(range(4, 15))
    poison = np.full((1, 2, 32), 99.0, np.float32)
    for p in card_cells:
        rows.host[p:p + 1] = poison
    got = rows[0:21]
    assert np.array_equal(got, want)
    for p in host_cells:
        rows.host[p:p + 1] = np.asarray(plain[p:p + 1]) + 1.0
    got = rows[0:21]
    assert np.array_equal(got[card_cells], want[card_cells])
    assert not np.array_equal(got[host_cells], want[host_cells])     # read from the host copy
    assert rows.nbytes == new_kv(np, (10, 2, 32), kv_type).nbytes    # 4 sinks + 6 on the device
    assert rows.host_nbytes == plain.nbytes


def test_a_write_after_a_rewind_refills_the_ring_from_the_host_copy():
    rng = np.random.default_rng(1)
    rows = RingKV(np, (64, 1, 32), "f32", sinks=4, ring=5)
    first, second = (rng.standard_normal((64, 1, 32)).astype(np.float32) for _ in range(2))
    for p in range(30):
        rows[p:p + 1] = first[p:p + 1]
    for p in range(17, 25):                 # rewound to 17: a diverging continuation
        rows[p:p + 1] = second[p:p + 1]
        want = np.concatenate([first[:17], second[17:p + 1]])
        assert np.array_equal(rows[0:p + 1], want), p
    with pytest.raises(TypeError):
        rows[np.arange(3)]


# ---- priced == carved -----------------------------------------------------------------------------

@pytest.mark.parametrize("arch,lb,le", [("qwen3moe", 0, 4), ("qwen3moe", 1, 3),
                                        ("qwen3next", 0, 8), ("qwen3next", 2, 5),
                                        ("qwen3next", 0, 3)])
@pytest.mark.parametrize("kv_type", ["f32", "q8_0"])
def test_sessions_carve_the_priced_device_and_host_parts(models, arch, lb, le, kv_type):
    path = models[arch]
    n_layers = 4 if arch == "qwen3moe" else 8
    shape = model_shape(GGUFModel(path), "cpu", kv_type)
    stage = Stage(StageConfig(path, "cpu", lb, le, lb == 0, le == n_layers, CELLS,
                              kv_type=kv_type, kv_resident=RESIDENT))
    s = stage.session(0)
    assert stage.session_bytes() == session_bytes(shape, CELLS, lb, le, RESIDENT)
    assert stage.kv_host_bytes() == session_host_bytes(shape, CELLS, lb, le, RESIDENT)
    if hasattr(s, "parts_nbytes"):
        assert s.parts_nbytes() == session_parts(shape, CELLS, lb, le, RESIDENT)
    whole = session_parts(shape, CELLS, lb, le)
    parts = session_parts(shape, CELLS, lb, le, RESIDENT)
    assert parts["kv"] * CELLS == whole["kv"] * RESIDENT       # the device keeps RESIDENT cells
    assert parts["kv_host"] == whole["kv"]                      # the host copy keeps every cell


# ---- the same tokens and logits -------------------------------------------------------------------

def _runner(path, kv_type, resident=0):
    return SingleProcessRunner(path, "cpu", max_context=CELLS, prompt_chunk=CHUNK,
                               kv_type=kv_type, kv_resident=resident)


def _greedy_logits(runner, prompt, steps):
    rows = [runner.feed(prompt)]
    for _ in range(steps):
        rows.append(runner.feed([int(rows[-1][-1].argmax())]))
    return np.concatenate(rows)


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next"])
@pytest.mark.parametrize("kv_type", ["f32", "q8_0"])
def test_logits_past_several_ring_wraps_equal_every_cell_resident(models, arch, kv_type):
    steps = 40                      # 35 + 40 cells: the ring of 9 wraps 7 times
    want = _greedy_logits(_runner(models[arch], kv_type), PROMPT, steps)
    got = _greedy_logits(_runner(models[arch], kv_type, RESIDENT), PROMPT, steps)
    assert np.abs(got - want).max() <= 1e-6


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next"])
def test_a_resumed_prefix_reads_on_as_every_cell_resident(models, arch):
    """A follow-up that shares the first 26 tokens and then diverges: the session moves back
    (to the prefix, or qwen3next's checkpoint at 24) past cells the ring held of the first
    answer, and reads on with the logits of every cell resident."""
    follow = PROMPT[:26] + [60, 61, 62, 63, 64]
    out = []
    for resident in (0, RESIDENT):
        r = SingleProcessRunner(models[arch], "cpu", max_context=CELLS, prompt_chunk=CHUNK,
                                checkpoint_every=CHUNK, kv_resident=resident)
        first = r.generate(PROMPT, 20).tokens
        reuse = r.resume_point(follow)            # where a resumed request reads on (stream)
        assert 0 < reuse < len(follow), reuse
        r.checkpoints.enter(r.session, reuse)
        out.append((first, reuse, _greedy_logits(r, follow[reuse:], 12)))
    assert out[1][:2] == out[0][:2]
    assert np.abs(out[1][2] - out[0][2]).max() <= 1e-6


def test_two_cpu_ranks_with_drafts_and_a_resumed_prompt_give_the_same_tokens(models):
    """Two CPU ranks with --kv-resident, --spec 3 (rejected drafts roll each stage back) and a
    follow-up resumed from a shared prefix: the tokens the single process gives with every
    cell resident."""
    path = models["qwen3moe"]
    follow = PROMPT[:26] + [60, 61, 62, 63, 64]
    ref = _runner(path, "f32")
    want = [ref.generate(PROMPT, 24).tokens, ref.generate(follow, 24, resume=True).tokens]
    serve = ServeSession(path, "--cpu-ranks", "2", "--layer-split", "2", "--max-context",
                         str(CELLS), "--prefill", str(CHUNK), "--kv-resident", str(RESIDENT),
                         "--spec", "3", timeout=120)
    try:
        assert any("13 cells resident" in line for line in serve.info + serve.stderr) or \
            serve.err_has("13 cells resident")
        first = serve.gen(PROMPT, 24, "stats=1", timeout=120)
        second = serve.gen(follow, 24, "stats=1", timeout=120)
    finally:
        serve.close()
    assert first["err"] is None and second["err"] is None, (first, second)
    assert [first["tokens"], second["tokens"]] == want
    assert second["resume"] == 26
    drafted = sum(int(s.get("drafted", 0)) for s in first["stats"] + second["stats"])
    accepted = sum(int(s.get("accepted", 0)) for s in first["stats"] + second["stats"])
    assert drafted > accepted          # some drafts were rejected: the stages rolled back


def _plan_json(path, *args):
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "--model", path, "--cpu-ranks",
                           "2", "--layer-split", "2", "--max-context", str(CELLS), "--prefill",
                           str(CHUNK), *args, "--plan-only", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_auto_gives_two_cpu_ranks_of_different_budgets_their_own_resident_cells(models):
    """--kv-resident auto on two CPU ranks whose budgets leave room for a few cells beyond the
    floor on one and some thirty more on the other: each stage keeps its own count (both below
    the prompt and its reply, so both rings wrap), the ranks carve what the plan priced (the
    launch checks each stage's session), and the tokens are those of every cell resident."""
    path = models["qwen3moe"]
    # each stage's weights, session and reserves at the floor's neighbour, from the plan itself
    # (a CPU rank's free memory is its budget)
    budget = 1 << 30
    at = _plan_json(path, "--kv-resident", str(RESIDENT), "--vram-budget", "1G,1G")["stages"]
    need = [budget - st["budget_bytes"] for st in at]        # fixed bytes at RESIDENT cells
    shape = model_shape(GGUFModel(path), "cpu", "f32")
    per_cell = [session_parts(shape, CELLS, st["lb"], st["le"], 1)["kv"] for st in at]
    prompt = shape.prompt_bytes(CHUNK)      # a stage's own prompt buffers (its cache is gone)
    room = [prompt + 5 * per_cell[0], prompt + 35 * per_cell[1]]
    flag = ",".join(f"{(n + r) // 1024}K" for n, r in zip(need, room))
    plan = _plan_json(path, "--kv-resident", "auto", "--vram-budget", flag)
    counts = [st.get("kv_resident", 0) for st in plan["stages"]]
    assert counts[0] != counts[1], counts
    assert all(RESIDENT <= n < len(PROMPT) + 24 for n in counts), counts
    assert counts[0] < counts[1], counts     # the larger room, the more cells
    want = _runner(path, "f32").generate(PROMPT, 24).tokens
    serve = ServeSession(path, "--cpu-ranks", "2", "--layer-split", "2", "--max-context",
                         str(CELLS), "--prefill", str(CHUNK), "--kv-resident", "auto",
                         "--vram-budget", flag, timeout=120)
    try:
        shown = "\n".join(serve.info + serve.stderr)
        got = serve.gen(PROMPT, 24, timeout=120)
    finally:
        serve.close()
    for stage, n in enumerate(counts):
        assert f"stage {stage} (" in shown and f"{n} cells resident" in shown, shown
    assert got["err"] is None, got
    assert got["tokens"] == want


# ---- refused at start -----------------------------------------------------------------------------

def _refused(argv, warned: str = ""):
    """The one error line of a refused run (`warned`: a warning line starting so comes first)."""
    done = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True,
                          timeout=120)
    lines = done.stderr.strip().splitlines()
    if warned and lines and lines[0].startswith(warned):
        lines = lines[1:]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


@pytest.mark.parametrize("tool", ["launch", "generate"])
def test_bad_values_are_refused_with_one_line(models, tool):
    path = models["qwen3moe"]
    base = (["launcher.cli", "--model", path, "--cpu-ranks", "1", "--prompt-ids", "1,2",
             "--max-new", "1", "--prefill", "16", "--max-context", "64"] if tool == "launch" else
            ["strata_dist.tools.cli", "generate", "--model", path, "--max-new", "1", "--prefill", "16",
             "--max-context", "64"])
    line = _refused(base + ["--kv-resident", "64"])
    assert "--kv-resident 64" in line and "--max-context 64" in line and "every cell" in line
    line = _refused(base + ["--kv-resident", "19"])
    assert "--kv-resident 19" in line and "floor of 20" in line and "--prefill 16" in line
    assert "sinks" in line
    line = _refused(base + ["--kv-resident", "lots"])
    assert "'lots'" in line
    for arch in ("qwen3next", "qwen3moe"):
        # the GPU ring kernels take f16 and q8_0 K/V only: f32 is refused on a GPU
        gpu = (["launcher.cli", "--model", models[arch], "--gpus", "0", "--prompt-ids", "1,2",
                "--max-new", "1"] if tool == "launch" else
               ["strata_dist.tools.cli", "generate", "--model", models[arch], "--device", "cuda:0"])
        line = _refused(gpu + ["--prefill", "16", "--max-context", "64", "--kv-resident", "32",
                               "--kv-type", "f32"], warned="warning: --kv-type f32")
        assert "--kv-resident 32" in line and ("--gpus 0" in line or "cuda:0" in line)
        assert "--kv-type f32" in line
    if tool == "generate":
        assert "strata-launch" in _refused(base + ["--kv-resident", "auto"])
    else:
        line = _refused(base + ["--kv-resident", "32", "--conversation-cache-mib", "8"])
        assert "--kv-resident 32" in line and "--conversation-cache-mib 8" in line


def test_gpu_ring_kernels_take_both_architectures_f16_and_q8_0(models, tmp_path):
    """Which --kv-resident runs the GPU ranks take (strata_dist/tools/cli.py gpu_kv_resident_refusal,
    the launcher's and the generate tool's check): qwen3moe's and qwen3next's f16 and q8_0 K/V
    (their decode graphs' ring builds), not f32, not an architecture without ring builds."""
    from hf_fixtures import tiny_qwen35moe, write_qwen35moe_gguf
    from strata_dist.tools.cli import gpu_kv_resident_refusal
    from strata_dist.models import open_checked
    for arch in ("qwen3moe", "qwen3next"):
        gguf = open_checked(models[arch])
        assert gpu_kv_resident_refusal(gguf, None, "cuda:0") == ""
        assert gpu_kv_resident_refusal(gguf, "f16", "cuda:0") == ""
        assert gpu_kv_resident_refusal(gguf, "q8_0", "cuda:0") == ""
        said = gpu_kv_resident_refusal(gguf, "f32", "cuda:0")
        assert "--kv-type f32" in said and "f16 or q8_0" in said and "cuda:0" in said
    other = open_checked(str(write_qwen35moe_gguf(tiny_qwen35moe(3), tmp_path / "q35.gguf")))
    said = gpu_kv_resident_refusal(other, None, "--gpus 0")
    assert "qwen35moe" in said and "--gpus 0" in said
