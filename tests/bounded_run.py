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
