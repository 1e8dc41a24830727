"""A command run with a bound on its time and memory (the hostile-input tests): a refusal must come
at once, not after a hang or a GB of allocations."""
import json
import subprocess
import sys

SECONDS, PEAK_MB = 10, 500

# Runs a command and reports its exit status, stderr, wall time and peak resident memory (the
# wrapper's only child is the command, so RUSAGE_CHILDREN is the command's own peak). The address
# space is capped far above the bound so a regression fails the test without taking the machine.
_BOUNDED = r"""
import json, resource, subprocess, sys, time
limit = 8 << 30
t0 = time.monotonic()
try:
    p = subprocess.run(sys.argv[2:], capture_output=True, text=True, timeout=float(sys.argv[1]),
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    rc, err = p.returncode, p.stderr
except subprocess.TimeoutExpired as e:
    rc, err = "timeout", (e.stderr or b"").decode(errors="replace")
peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(json.dumps({"rc": rc, "stderr": err, "s": time.monotonic() - t0, "mb": peak_kb / 1024}))
"""


def bounded(*argv, seconds=SECONDS):
    out = subprocess.run([sys.executable, "-c", _BOUNDED, str(seconds), sys.executable, *argv],
                         capture_output=True, text=True, timeout=seconds + 60)
    return json.loads(out.stdout)


def refused_in_bounds(result, *needles):
    assert result["rc"] == 2, result
    assert result["s"] < SECONDS and result["mb"] < PEAK_MB, result
    err = result["stderr"]
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: "), err
    for needle in needles:
        assert needle in last, last


# The same bound for a command that reads stdin and writes stdout (the --serve tests): a small
# Python process runs it as its only child (its address space capped as above) and writes the
# child's peak (RUSAGE_CHILDREN) to a file.
# The peak is never read from the test's own wait4: a process started from the test process counts
# the test process's high-water mark as its own (Linux keeps it across exec), and a full suite's
# test process holds torch.
_PASS_THROUGH = r"""
import resource, subprocess, sys
limit = 8 << 30
code = subprocess.Popen(sys.argv[2:], preexec_fn=lambda: resource.setrlimit(
    resource.RLIMIT_AS, (limit, limit))).wait()
with open(sys.argv[1], "w") as f:
    f.write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
sys.exit(code if code >= 0 else 128 - code)
"""


def run_bounded(argv: list[str], feed: bytes | None = None, seconds: float = SECONDS,
                peak_mb: float = PEAK_MB) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `argv`, which must end within `seconds` without passing
    `peak_mb` resident; past either the test fails (the command's process group killed). `feed`:
    its stdin."""
    import os
    import signal
    import tempfile
    import threading
    with tempfile.NamedTemporaryFile("r", suffix=".peak") as peak_file:
        proc = subprocess.Popen([sys.executable, "-c", _PASS_THROUGH, peak_file.name, *argv],
                                stdin=subprocess.DEVNULL if feed is None else subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        out: dict[str, bytes] = {}
        threads = [threading.Thread(target=lambda k=k, f=f: out.__setitem__(k, f.read()), daemon=True)
                   for k, f in (("out", proc.stdout), ("err", proc.stderr))]
        if feed is not None:
            threads.append(threading.Thread(target=_feed, args=(proc.stdin, feed), daemon=True))
        for t in threads:
            t.start()
        try:
            proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
            raise AssertionError(f"{argv[1:]}: still running after {seconds} s") from None
        for t in threads:
            t.join(timeout=5)
        peak = int(peak_file.read() or 0) / 1024     # KiB on Linux
    assert peak <= peak_mb, f"{argv[1:]}: peak {peak:.0f} MB resident"
    text = {k: v.decode(errors="replace") for k, v in out.items()}
    return proc.returncode, text.get("out", ""), text.get("err", "")


def _feed(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.close()
    except (BrokenPipeError, OSError):
        pass
