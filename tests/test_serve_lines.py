"""`strata-launch --serve` served to the end of its input, CANCEL and the stop signals, with real
rank processes: piped GENs are each answered in full before QUIT or the end of input ends the run
(exit 0); CANCEL (or a SIGINT) ends the running generation and the next one is served; a second
SIGINT, SIGTERM and SIGHUP stop the launch cleanly (ranks gone, run directory removed, exit 130,
no traceback), a Ctrl-C during startup too. And flags that would make the launcher wait or read
without bound are refused at once: NaN/inf seconds, a file flag naming /dev/zero."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from bounded_run import run_bounded
from launch_helpers import LineProcess, ServeSession, launcher_children, wait_gone, wait_or_kill

TIMEOUT = 60
FIRST, SECOND = [300, 301, 302], [5, 6, 7]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from strata_dist.synth import write_synthetic
    path = tmp_path_factory.mktemp("serve") / "m.gguf"
    write_synthetic(path, like="tiny", quant="f32", popularity="zipf:1.0", seed=0)
    return str(path)


@pytest.fixture
def hangup_default():
    """Processes started in the test take SIGHUP's default (as from a terminal), even where the
    tests run under nohup (an ignored SIGHUP is inherited, and the launcher keeps it ignored)."""
    before = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGHUP, before)


def launcher(*args: str) -> list[str]:
    return [sys.executable, "-m", "launcher.cli", *args]


def answers(stdout: str) -> list[tuple[list[int], list[str]]]:
    """(tokens, DONE fields) of each GEN answered, in order; ERR lines fail the caller."""
    out, tokens = [], []
    for line in stdout.splitlines():
        assert not line.startswith("ERR"), stdout
        if line.startswith("T "):
            tokens.append(int(line[2:]))
        elif line.startswith("DONE"):
            out.append((tokens, line.split()[1:]))
            tokens = []
    return out


def run_dir(stderr: str) -> str:
    found = re.search(r"logs in (\S+)", stderr)
    assert found, stderr
    return found.group(1)


def gen(n: int, ids: list[int]) -> bytes:
    return f"GEN {n} {' '.join(map(str, ids))}\n".encode()


def piped(model: str, feed: bytes, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(launcher("--model", model, "--cpu-ranks", "1", "--serve", *args),
                          input=feed, capture_output=True, timeout=TIMEOUT)


@pytest.mark.parametrize("tail", [b"QUIT\n", b""], ids=["quit", "eof"])
def test_piped_gens_are_answered_in_full_before_quit_or_eof(model, tail):
    """`printf 'GEN 16 …\\nGEN 8 …\\nQUIT\\n' | strata-launch … --serve`: QUIT (or the end of
    input) read while the first GEN runs waits its turn; both GENs run to max_new."""
    proc = piped(model, gen(16, FIRST) + gen(8, SECOND) + tail)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    got = answers(proc.stdout.decode())
    assert [(len(t), d[0], d[-1]) for t, d in got] == [(16, "16", "length"), (8, "8", "length")]


def test_one_echoed_gen_is_answered_in_full(model):
    """`echo 'GEN 16 …' | strata-launch … --serve` on a pipeline of two stages."""
    proc = subprocess.run(launcher("--model", model, "--cpu-ranks", "2", "--layer-split", "2",
                                   "--serve"), input=gen(16, FIRST), capture_output=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    got = answers(proc.stdout.decode())
    assert len(got) == 1 and len(got[0][0]) == 16 and got[0][1][-1] == "length", got


def test_cancel_applies_to_the_gen_before_it_in_order(model):
    """Lines are served in order: a CANCEL behind a queued GEN cancels that one, not the GEN
    running when it is read; a CANCEL with nothing running is ignored (it came too late)."""
    feed = b"CANCEL\n" + gen(16, FIRST) + gen(3000, SECOND) + b"CANCEL\n" + gen(8, FIRST) + b"QUIT\n"
    proc = piped(model, feed)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    got = answers(proc.stdout.decode())
    assert [d[-1] for _, d in got] == ["length", "cancelled", "length"], got
    assert len(got[0][0]) == 16 and len(got[1][0]) < 3000 and len(got[2][0]) == 8


def _until_tokens(session: LineProcess, n: int) -> None:
    seen = 0
    while seen < n:
        line = session.next_line(TIMEOUT)
        assert not line.startswith(("ERR", "DONE")), line
        seen += line.startswith("T ")


def _done(session: LineProcess) -> list[str]:
    while True:
        line = session.next_line(TIMEOUT)
        assert not line.startswith("ERR"), line
        if line.startswith("DONE"):
            return line.split()[1:]


def test_cancel_mid_generation_ends_it_and_the_next_gen_is_served(model):
    s = ServeSession(model, "--cpu-ranks", "2", "--layer-split", "2")
    try:
        s.send(gen(3000, FIRST).decode().strip())
        _until_tokens(s, 3)
        s.send("CANCEL")
        done = _done(s)
        assert done[-1] == "cancelled" and int(done[0]) < 3000, done
        nxt = s.gen(SECOND, 8)
        assert len(nxt["tokens"]) == 8 and nxt["done"][-1] == "length", nxt
    except BaseException:
        s.close()
        raise
    assert s.close() == 0, s.err()


def _stopped_cleanly(s: ServeSession, ranks: list[int], code: int = 130) -> None:
    assert wait_or_kill(s.proc, 30) == code, s.err()
    assert "Traceback" not in s.err(), s.err()
    assert not os.path.exists(run_dir(s.err())), s.err()
    assert wait_gone(ranks) == []


def test_sigint_cancels_the_running_generation_and_sigint_while_idle_exits(model):
    s = ServeSession(model, "--cpu-ranks", "1")
    ranks = launcher_children(s.proc.pid)
    try:
        s.send(gen(3000, FIRST).decode().strip())
        _until_tokens(s, 3)
        s.proc.send_signal(signal.SIGINT)
        done = _done(s)
        assert done[-1] == "cancelled" and int(done[0]) < 3000, done
        nxt = s.gen(SECOND, 8)
        assert len(nxt["tokens"]) == 8 and nxt["done"][-1] == "length", nxt
        time.sleep(0.2)
        s.proc.send_signal(signal.SIGINT)       # nothing runs: the launch stops
        _stopped_cleanly(s, ranks)
    finally:
        wait_or_kill(s.proc, 5)


def test_a_second_sigint_during_a_generation_exits(model):
    s = ServeSession(model, "--cpu-ranks", "1")
    ranks = launcher_children(s.proc.pid)
    try:
        s.send(gen(3000, FIRST).decode().strip())
        _until_tokens(s, 3)
        s.proc.send_signal(signal.SIGINT)
        time.sleep(0.1)
        s.proc.send_signal(signal.SIGINT)
        _stopped_cleanly(s, ranks)
    finally:
        wait_or_kill(s.proc, 5)


def test_sighup_stops_like_sigterm(model, hangup_default):
    """A terminal closing (SIGHUP) mid-generation: every rank stopped, the run directory
    removed, exit 130 and no traceback, as SIGTERM does."""
    s = ServeSession(model, "--cpu-ranks", "2", "--layer-split", "2")
    ranks = launcher_children(s.proc.pid)
    assert len(ranks) == 2
    try:
        s.send(gen(3000, FIRST).decode().strip())
        _until_tokens(s, 3)
        s.proc.send_signal(signal.SIGHUP)
        _stopped_cleanly(s, ranks)
    finally:
        wait_or_kill(s.proc, 5)


def test_a_sighup_ignored_at_start_stays_ignored(model):
    """Started under nohup (SIGHUP ignored), the launcher keeps serving when the terminal goes."""
    argv = launcher("--model", model, "--serve", "--cpu-ranks", "1")
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, bufsize=1,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    s = LineProcess(proc)
    try:
        s.wait_ready(TIMEOUT)
        proc.send_signal(signal.SIGHUP)
        got = s.gen(FIRST, 8)
        assert len(got["tokens"]) == 8 and got["done"][-1] == "length", got
    except BaseException:
        s.close()
        raise
    assert s.close() == 0, s.err()


def _catches_sighup(pid: int) -> bool:
    """Whether the process has a handler for SIGHUP (/proc's SigCgt mask): the launcher installs
    its stop handlers first thing, before its imports; Python itself catches no SIGHUP."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) & (1 << (signal.SIGHUP - 1)))
    except OSError:
        pass
    return False


@pytest.mark.parametrize("delay", [0.0, 0.03, 0.1, 0.2, 0.4])
def test_sigint_during_startup_exits_quietly(model, delay, hangup_default):
    """Ctrl-C while the launcher is still importing (about 0.2 s of it), planning or loading:
    exit 130, no traceback, nothing left behind. Counted from the moment the launcher's own code
    runs (before that, the interpreter is starting, which no handler of ours can cover)."""
    proc = subprocess.Popen(launcher("--model", model, "--cpu-ranks", "1", "--serve"),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while not _catches_sighup(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, \
                "the launcher installed no stop handler"
            time.sleep(0.002)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        wait_or_kill(proc, 5)
    text = err.decode(errors="replace")
    assert proc.returncode == 130, text
    assert "Traceback" not in text, text
    found = re.search(r"logs in (\S+)", text)
    assert found is None or not os.path.exists(found.group(1)), text


# ---- refusals bounded in time and memory ---------------------------------------------------------

def refused_at_once(argv: list[str], *needles: str) -> str:
    code, _, err = run_bounded(argv)
    assert code == 2, (code, err)
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: "), err
    for needle in needles:
        assert needle in last, last
    return last


@pytest.mark.parametrize("flag,value", [("--load-timeout", "nan"), ("--load-timeout", "inf"),
                                        ("--load-timeout", "-1"), ("--load-timeout", "0"),
                                        ("--register-timeout", "nan"),
                                        ("--register-timeout", "inf")])
def test_seconds_that_are_not_finite_and_positive_are_refused(model, flag, value):
    refused_at_once(launcher("--model", model, "--cpu-ranks", "1", "--serve", flag, value),
                    f"{flag} {float(value)}")


def test_serve_with_parallel_is_refused_naming_both():
    """The line protocol answers one GEN at a time (its T and DONE lines name no request): a
    batch of B > 1 has no way to speak there, so asking for one is refused at once. The check
    comes before the model is opened: a path that does not exist shows it never loads."""
    last = refused_at_once(launcher("--model", "/nonexistent.gguf", "--cpu-ranks", "1",
                                    "--serve", "--parallel", "4"),
                           "--serve and --parallel 4", "--port")
    assert "one GEN at a time" in last, last


@pytest.mark.parametrize("flag,value", [("--connect-timeout", "nan"),
                                        ("--coordinator-timeout", "-1"),
                                        ("--assign-timeout", "inf")])
def test_a_rank_refuses_seconds_that_are_not_finite_and_positive(model, tmp_path, flag, value):
    refused_at_once([sys.executable, "-m", "strata_dist.rank.main", "--coordinator",
                     f"ipc://{tmp_path}/nobody", "--model", model, "--vram-budget", "1G",
                     flag, value], f"{flag} {float(value)}")


def test_the_calibration_peer_refuses_nan_idle_seconds():
    refused_at_once([sys.executable, "-m", "strata_dist.tools.cli", "calibrate", "--serve",
                     "127.0.0.1:9", "--idle", "nan"], "--idle nan")


@pytest.mark.parametrize("args,flag,cap", [
    (["--port", "0", "--api-key-file"], "--api-key-file", 64 << 10),
    (["--cpu-ranks", "1", "--serve", "--token-file"], "--token-file", 64 << 10),
    (["--plan-only", "--calibration"], "--calibration", 1 << 20),
    (["--plan-only", "--expert-profile"], "--expert-profile", 16 << 20),
    (["--plan-only", "--inventory"], "--inventory", 4 << 20),
], ids=lambda x: x if isinstance(x, str) and x.startswith("--") else None)
def test_a_launcher_file_flag_naming_dev_zero_is_refused_at_once(model, args, flag, cap):
    refused_at_once(launcher("--model", model, *args, "/dev/zero"),
                    f"{flag} /dev/zero: larger than {cap} bytes")


def test_the_tools_and_the_rank_read_their_files_with_a_bound(model, tmp_path):
    refused_at_once([sys.executable, "-m", "strata_dist.tools.cli", "profile", "--model", model,
                     "--prompt-ids-file", "/dev/zero", "--out", str(tmp_path / "p.json")],
                    f"--prompt-ids-file /dev/zero: larger than {16 << 20} bytes")
    refused_at_once([sys.executable, "-m", "strata_dist.rank.main", "--coordinator",
                     f"ipc://{tmp_path}/nobody", "--model", model, "--vram-budget", "1G",
                     "--token-file", "/dev/zero"],
                    f"--token-file /dev/zero: larger than {64 << 10} bytes")


def test_a_curve_key_file_that_is_dev_zero_is_refused_at_once(model, tmp_path):
    keys = tmp_path / "curve"
    keys.mkdir()
    (keys / "server.key_secret").symlink_to("/dev/zero")
    refused_at_once(launcher("--model", model, "--cpu-ranks", "1", "--serve", "--curve-keys",
                             str(keys)),
                    f"--curve-keys {keys}/server.key_secret: larger than {64 << 10} bytes")


def test_sighup_ends_open_http_streams_with_a_message(model, hangup_default):
    """`--port`: a terminal closing (SIGHUP) mid-stream ends the stream with the server's error
    event and [DONE], as SIGTERM does, then every rank stops and the run directory goes."""
    import json

    import httpx

    from server_helpers import ServerProcess
    s = ServerProcess(model, "--cpu-ranks", "2", "--layer-split", "2", "--vram-budget", "1G")
    ranks = launcher_children(s.proc.pid)
    try:
        body = {"model": os.path.basename(model).removesuffix(".gguf"), "prompt": [5, 6, 7],
                "max_tokens": 4000, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=30) as http:
            resp = http.send(http.build_request("POST", f"{s.url}/v1/completions", json=body),
                             stream=True)
            lines = resp.iter_lines()
            while '"token_ids": [' not in next(lines):
                pass
            s.proc.send_signal(signal.SIGHUP)
            rest = [x for x in lines if x]
            resp.close()
        assert rest[-1] == "data: [DONE]", rest[-3:]
        err = json.loads(next(x for x in rest if x.startswith('data: {"error"'))[6:])["error"]
        assert err["message"] == "the server is stopping"
        assert s.proc.wait(timeout=20) == 130
        stderr = "".join(s.stderr)
        assert "Traceback" not in stderr, stderr
        assert not os.path.exists(run_dir(stderr)), stderr
        assert wait_gone(ranks) == []
    finally:
        s.close()


def test_a_line_past_the_bound_is_dropped_with_err_and_the_next_is_served(model):
    """A 32 MB line (a client gone wrong, `< /dev/zero`) is read and dropped in bounded memory
    (it was held whole and split into 16 million words: gigabytes), answered ERR, and the GEN
    after it is served."""
    feed = b"GEN 4 " + b"7 " * (16 << 20) + b"\n" + gen(4, FIRST) + b"QUIT\n"
    code, out, err = run_bounded(launcher("--model", model, "--cpu-ranks", "1", "--serve"), feed)
    assert code == 0, err
    errs = [line for line in out.splitlines() if line.startswith("ERR")]
    assert len(errs) == 1 and "longer than" in errs[0], out[-2000:]
    done = [line for line in out.splitlines() if line.startswith("DONE")]
    assert len(done) == 1 and done[0].split()[1] == "4", out[-2000:]
