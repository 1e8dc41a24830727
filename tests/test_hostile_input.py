"""Bad input gets one `error: …` line naming what is wrong and exit status 2, never a traceback or
a hang: malformed metadata, unusable paths and devices, impossible flags, and bytes on the --serve
line protocol that are not UTF-8."""
import importlib.util
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGUFValueType as VT

from hf_fixtures import tiny_qwen3moe, write_gguf

TIMEOUT = 120


def tool(*args, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "strata_dist.tools.cli", *args], capture_output=True,
                          text=True, timeout=TIMEOUT, env=env, **kw)


def launch(*args, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True,
                          text=True, timeout=TIMEOUT, env=dict(os.environ, **(env or {})), **kw)


def refused(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in last, last


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny synthetic model: it has a tokenizer, so text prompts are read too."""
    from strata_dist.synth import write_synthetic
    path = tmp_path_factory.mktemp("hostile") / "m.gguf"
    write_synthetic(path, like="tiny", quant="f32", popularity="zipf:1.0", seed=0)
    return str(path)


@pytest.mark.parametrize("key,value,vtype,needle", [
    ("attention.head_count", 0, VT.UINT32, "qwen3moe.attention.head_count"),
    ("block_count", 0, VT.UINT32, "qwen3moe.block_count"),
    ("embedding_length", "wide", VT.STRING, "qwen3moe.embedding_length"),
    ("expert_used_count", 99, VT.UINT32, "qwen3moe.expert_used_count"),
    ("attention.layer_norm_rms_epsilon", -1e-6, VT.FLOAT32, "layer_norm_rms_epsilon"),
    ("rope.freq_base", float("nan"), VT.FLOAT32, "qwen3moe.rope.freq_base"),
])
def test_bad_metadata_names_the_file_and_the_key(tmp_path, key, value, vtype, needle):
    bad = write_gguf(tiny_qwen3moe(5), tmp_path / "bad.gguf", metadata={key: (value, vtype)})
    refused(tool("generate", "--model", bad, "--max-new", "2"), str(bad), needle)


def test_qwen3next_time_step_rank_zero(tmp_path):
    from hf_next_fixtures import tiny_qwen3next, write_gguf as write_next
    good = write_next(tiny_qwen3next(1), tmp_path / "next.gguf", "f32")
    from gguf import GGUFReader, GGUFWriter
    # a copy with ssm.time_step_rank = 0: every other key and tensor as the good file has them
    r = GGUFReader(good)
    w = GGUFWriter(str(tmp_path / "bad.gguf"), "qwen3next")
    for field in r.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == VT.ARRAY else None
        if field.name == "qwen3next.ssm.time_step_rank":
            value = 0
        w.add_key_value(field.name, value, vtype, sub_type=sub_type)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_shape=list(reversed(t.shape.tolist())), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    refused(tool("generate", "--model", str(tmp_path / "bad.gguf"), "--max-new", "2"),
            "qwen3next.ssm.time_step_rank")


def test_unwritable_outputs_are_refused_before_any_work(model, tmp_path):
    refused(tool("logits", "--model", model, "--tokens", "1,2", "--out", "/nonexistent/x.npy"),
            "/nonexistent")
    refused(tool("synth", str(tmp_path / "no" / "dir" / "x.gguf"), "--quiet"), "does not exist")
    # a folder as the output is refused naming it (numpy would have written FOLDER.npy beside it)
    refused(tool("logits", "--model", model, "--tokens", "1,2", "--out", str(tmp_path)),
            f"--out {tmp_path} is a folder")
    assert not (tmp_path.parent / (tmp_path.name + ".npy")).exists()
    # calibrate and profile refuse it before measuring or running, not with a traceback after
    refused(tool("calibrate", "--out", str(tmp_path)), f"--out {tmp_path} is a folder")
    refused(tool("calibrate", "--out", "/nonexistent/c.json"), "/nonexistent")
    ids = tmp_path / "ids.txt"
    ids.write_text("1,2,3\n")
    refused(tool("profile", "--model", model, "--prompt-ids-file", str(ids), "--out",
                 str(tmp_path)), f"--out {tmp_path} is a folder")


def test_logits_land_at_the_path_given_and_a_prompt_past_the_context_names_both(model, tmp_path):
    out = tmp_path / "logits"                 # no .npy suffix: written where asked all the same
    done = tool("logits", "--model", model, "--tokens", "1,2", "--out", str(out))
    assert done.returncode == 0 and f"to {out}" in done.stderr, done.stderr
    assert np.load(out).shape[0] == 2
    refused(tool("logits", "--model", model, "--tokens", "1,2,3", "--max-context", "2", "--out",
                 str(out)), "the 3 tokens exceed the context of 2 (--max-context)")


def test_a_cuda_device_without_cuda(model):
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here")
    refused(tool("generate", "--model", model, "--device", "cuda:0"), "cuda:0")


@pytest.mark.parametrize("command", [
    "strata_dist.tools.cli generate --max-new 300",
    "launcher.cli --cpu-ranks 1 --prompt-ids 1,2,3 --max-new 300",
    "launcher.cli --cpu-ranks 1 --plan-only",
    "launcher.cli --cpu-ranks 1 --serve",
], ids=["generate", "launch", "plan-only", "serve"])
def test_output_closed_early_is_no_traceback(model, command):
    """`… | true`: the reader is gone before the first line; every tool stops quietly (and a
    launch closes its ranks: the test's timeout would catch one left running)."""
    tool_name, _, flags = command.partition(" ")
    feed = "(echo 'GEN 50 1 2 3'; sleep 2; echo QUIT) | " if "--serve" in flags else ""
    proc = subprocess.run(f"{feed}{sys.executable} -m {tool_name} --model {model} {flags} | true",
                          shell=True, capture_output=True, text=True, timeout=TIMEOUT)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("module,extra", [("strata_dist.tools.cli", ["generate"]),
                                          ("launcher.cli", ["--cpu-ranks", "1"])],
                         ids=["generate", "launch"])
def test_a_prompt_that_is_not_utf8_is_refused(model, module, extra):
    """Bytes that are not UTF-8 in argv reach Python as lone surrogates, which the tokenizer
    cannot read: refused at start, naming the flag."""
    proc = subprocess.run([sys.executable.encode(), b"-m", module.encode(),
                           *[a.encode() for a in extra], b"--model", model.encode(),
                           b"--prompt", b"a\xffb"], capture_output=True, timeout=TIMEOUT)
    refused(subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode(),
                                        proc.stderr.decode(errors="replace")),
            "--prompt is not valid Unicode")


def _without_root_file_access():
    """In the child before exec: drop the two capabilities that let root read any file
    (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH) from the bounding set, so the tool meets a file's
    mode bits as any user would."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:          # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_a_model_file_that_cannot_be_read(model, tmp_path):
    """A file without read permission names the file and the reason (exit 2, no traceback)."""
    locked = tmp_path / "locked.gguf"
    locked.write_bytes(open(model, "rb").read())
    locked.chmod(0o000)
    try:
        proc = subprocess.run([sys.executable, "-m", "strata_dist.tools.cli", "generate", "--model",
                               str(locked)], capture_output=True, text=True, timeout=TIMEOUT,
                              preexec_fn=_without_root_file_access if os.geteuid() == 0 else None)
    except subprocess.SubprocessError as e:
        pytest.skip(f"cannot drop root's file access here: {e}")
    refused(proc, str(locked), "cannot be read")


@pytest.mark.parametrize("args,needle", [
    (["--prompt-ids", ""], "--prompt-ids is empty"),
    (["--prompt", ""], "--prompt encodes to no tokens"),
    (["--vram-budget", "99999999T", "--prompt-ids", "1,2"], "99999999T"),
    (["--heartbeat-timeout", "nan", "--prompt-ids", "1,2"], "--heartbeat-timeout nan"),
])
def test_launch_refuses_at_start(model, args, needle):
    refused(launch("--model", model, "--cpu-ranks", "1", *args), needle)


def test_gpus_without_nvml(model):
    try:
        import pynvml
        pynvml.nvmlInit()
        pytest.skip("NVML answers here")
    except Exception:
        pass
    refused(launch("--model", model, "--gpus", "0", "--prompt-ids", "1,2"), "NVML")


def test_listen_on_a_port_in_use(model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        refused(launch("--model", model, "--listen", f"127.0.0.1:{port}", "--expect-ranks", "1",
                       "--prompt-ids", "1,2", env={"STRATA_TOKEN": "0123456789abcdef0123"}),
                "cannot listen", str(port))


def test_serve_answers_err_to_bytes_that_are_not_utf8_and_goes_on(model):
    lines = (b"GEN 2 1 2\n\xff\xfe GEN\nGENX 2 1 2\nGEN 2 temperature=nan 1 2\n"
             b"GEN 2 temperature=1 seed=-1 1 2\nGEN 2 top_k=99999999999999999999 1 2\n"
             b"GEN 2 seed=1e400 1 2\nGEN 2 1 2 temperature=0.5\nGEN 2 3 4\nQUIT\n")
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "--model", model, "--cpu-ranks",
                           "1", "--serve"], input=lines, capture_output=True, timeout=TIMEOUT,
                          env=dict(os.environ, PYTHONIOENCODING="utf-8"))
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    out = [l for l in proc.stdout.decode().splitlines() if not l.startswith("INFO")]
    errs = [l for l in out if l.startswith("ERR")]
    assert len(errs) == 7, out
    assert "GENX" in errs[1] and "temperature" in errs[2]
    # refused at parse, in the line protocol's words, not by a rank mid-request
    assert errs[3] == "ERR seed must be in [0, 2^64), got -1", errs[3]
    assert errs[4].startswith("ERR top_k must be in [0, 2147483647]"), errs[4]
    assert errs[5] == "ERR option seed='1e400' is not an integer", errs[5]
    # an option after the ids is named as misplaced, not as a token id that is no integer
    assert errs[6] == ("ERR option 'temperature=0.5' after the token ids: options come first "
                       "(GEN <max_new> [key=val …] <id> <id> …)"), errs[6]
    assert sum(l.startswith("DONE") for l in out) == 2, out


@pytest.mark.parametrize("tail", [b"QUIT\n", b""], ids=["quit", "eof"])
def test_cancel_read_ahead_ends_the_running_generation(model, tail):
    """CANCEL behind a long GEN ends it at once (DONE … cancelled), on a pipeline of two stages,
    instead of running to max_new; QUIT (or the end of input) then ends the run. QUIT alone
    cancels nothing: tests/test_serve_lines.py."""
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "--model", model, "--cpu-ranks",
                           "2", "--layer-split", "2", "--serve"],
                          input=b"GEN 3000 1 2 3\nCANCEL\n" + tail, capture_output=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    done = [l for l in proc.stdout.decode().splitlines() if l.startswith("DONE")]
    assert len(done) == 1 and done[0].endswith("cancelled"), done
    assert int(done[0].split()[1]) < 3000
