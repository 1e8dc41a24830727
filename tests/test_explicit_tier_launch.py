"""An explicit helper tier (--expert-cache-device N=MiB) is a hard requirement where it opens: a
rank that cannot allocate it stops the launch naming its card, where an automatic tier would be
skipped (fail soft). Real CPU ranks started by hand (strata-rank) register with a launcher
listening on loopback; the helper rank's address space is capped (RLIMIT_AS, set on the running
process once it waits for its assignment) below what its tier needs, so its allocation fails
for real."""
import os
import resource
import socket
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from protocol.auth import write_secret

TIER_MIB = 120          # the explicit tier: pairs of 768 KiB each
SLACK = 48 << 20        # what the rank allocates between its registration and its tier, besides the map


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from strata_dist.synth import GEOMETRIES, write_synthetic
    d = tmp_path_factory.mktemp("explicit-launch")
    # 4 layers x 48 experts of f32 256 x 256 (gate, up, down): 144 MiB of experts, so the tier
    # of 120 MiB is full and its arena far past the slack
    g = replace(GEOMETRIES["tiny"], name="wide", n_embd=256, n_ff_exp=256, n_expert=48, n_head=4,
                n_head_kv=2, head_dim=64)
    model = d / "wide.gguf"
    write_synthetic(model, like=g, quant="f32", popularity="uniform")
    write_secret(str(d / "token"), "t" * 48)
    return {"model": str(model), "token": str(d / "token"), "dir": d}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connected_to(pid: int, port: int) -> bool:
    """Whether process `pid` holds an established TCP connection to 127.0.0.1:port (it has
    registered and waits for its assignment)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    with open(f"/proc/{pid}/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    want = f"0100007F:{port:04X}"
    return any(r[2] == want and r[3] == "01" and r[9] in inodes for r in rows)


def vm_size(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    return kb << 10


def start_rank(files, port: int, rank: int, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "strata_dist.rank.main", "--coordinator",
                             f"tcp://127.0.0.1:{port}", "--model", files["model"], "--vram-budget", "2G",
                             "--token-file", files["token"], "--rank", str(rank),
                             "--connect-timeout", "10", "--assign-timeout", "60"],
                            stdout=log, stderr=subprocess.STDOUT, text=True)


def stop(*procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


def test_an_explicit_tier_that_cannot_open_stops_the_launch_naming_its_card(files):
    port = free_port()
    head = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "--model", files["model"], "--listen",
         f"tcp://127.0.0.1:{port}", "--expect-ranks", "3", "--token-file", files["token"],
         "--register-timeout", "60", "--load-timeout", "60", "--layer-split", "2",
         "--stage-gpus", "0,1", "--expert-cache", "1", "--no-remote-auto",
         "--expert-cache-device", f"2={TIER_MIB}", "--prompt-ids", "1,2,3", "--max-new", "2",
         "--prefill", "16", "--max-context", "256"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    logs = [open(files["dir"] / f"rank{i}.log", "w+") for i in range(3)]
    ranks = []
    try:
        helper = start_rank(files, port, 2, logs[2])
        ranks.append(helper)
        deadline = time.monotonic() + 60
        while not connected_to(helper.pid, port):
            assert helper.poll() is None, "the helper rank exited before registering"
            assert time.monotonic() < deadline, "the helper rank never registered"
            time.sleep(0.1)
        # waiting for its assignment now: from here it maps the model and allocates its tier
        cap = vm_size(helper.pid) + os.path.getsize(files["model"]) + SLACK
        resource.prlimit(helper.pid, resource.RLIMIT_AS, (cap, cap))
        ranks += [start_rank(files, port, r, logs[r]) for r in (0, 1)]
        out, err = head.communicate(timeout=120)
    finally:
        stop(head, *ranks)
    logs[2].seek(0)
    helper_log = logs[2].read()
    assert "did not open" in helper_log and "allocate" in helper_log, helper_log   # the real failure
    assert head.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: rank 2 ("), err           # the card: "host:2 cpu"
    assert f"2 cpu): its explicit helper tier (--expert-cache-device, {TIER_MIB}.0 MiB asked" in last
    assert "did not open" in last
    assert "did not open; skipped" not in err     # not the automatic tiers' fail-soft path
    assert out == ""                       # nothing was generated
