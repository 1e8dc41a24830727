"""`strata-dist deploy systemd`: the units, one environment file per host, the secret (0600) and the
CURVE key; the units pass `systemd-analyze verify`, and their command lines, expanded the way
systemd expands them, are accepted by strata-rank and strata-launch."""
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys

import pytest

from launcher.cli import build_parser as launch_parser
from launcher.deploy import parse_hosts
from launcher.tools import main as tools_main
from protocol.transport import load_curve_keys
from strata_dist.rank.main import build_parser as rank_parser


def deploy(tmp_path, *extra, capsys=None):
    out = tmp_path / "out"
    code = tools_main(["deploy", "systemd", "--coordinator", "hostA:5555", "--hosts", "hostA:0,1",
                       "hostB:0", "--model", "/models/M.gguf", "--out", str(out),
                       "--bin-dir", os.path.dirname(sys.executable), *extra])
    return code, out


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def env_of(path) -> dict[str, str]:
    pairs = [line.split("=", 1) for line in open(path).read().splitlines()
             if line and not line.startswith("#")]
    return dict(pairs)


def exec_start(unit_text: str, env: dict[str, str], instance: str = "") -> list[str]:
    """ExecStart as systemd runs it: ${VAR} is one word, $VAR splits on whitespace, %i the instance."""
    line = next(l for l in unit_text.splitlines() if l.startswith("ExecStart="))[len("ExecStart="):]
    words = []
    for word in shlex.split(line.replace("%i", instance)):
        if re.fullmatch(r"\$\w+", word):
            words += env.get(word[1:], "").split()
        else:
            words.append(re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), ""), word))
    return words


def test_deploy_writes_units_env_files_secret_and_curve_key(tmp_path, capsys):
    code, out = deploy(tmp_path, "--curve")
    assert code == 0
    said = capsys.readouterr().out
    assert "sudo sh /tmp/strata-deploy/install.sh" in said and "hostB (strata-rank@0)" in said
    a, b = out / "hostA", out / "hostB"
    assert sorted(os.listdir(a)) == ["curve", "install.sh", "strata-coordinator.service",
                                     "strata-rank@.service", "strata.env", "token"]
    assert "strata-coordinator.service" not in os.listdir(b)
    for host in (a, b):
        assert mode(host / "token") == 0o600 and mode(host / "curve" / "server.key_secret") == 0o600
        assert mode(host / "curve") == 0o700
    assert (a / "token").read_text() == (b / "token").read_text()
    assert len((a / "token").read_text().strip()) == 64
    assert load_curve_keys(str(a / "curve")) == load_curve_keys(str(b / "curve"))
    env_a, env_b = env_of(a / "strata.env"), env_of(b / "strata.env")
    assert env_a["STRATA_COORDINATOR"] == env_b["STRATA_COORDINATOR"] == "tcp://hostA:5555"
    assert env_b["STRATA_HOST_ID"] == "hostB" and "STRATA_LISTEN" not in env_b
    assert env_a["STRATA_LISTEN"] == "tcp://0.0.0.0:5555" and env_a["STRATA_EXPECT_RANKS"] == "3"
    assert env_a["STRATA_CURVE_ARGS"] == "--curve-keys /etc/strata-dist/curve"
    assert "systemctl enable --now strata-coordinator.service strata-rank@0.service " \
           "strata-rank@1.service" in (a / "install.sh").read_text()
    assert "systemctl enable --now strata-rank@0.service\n" in (b / "install.sh").read_text()
    for unit in ("strata-rank@.service", "strata-coordinator.service"):
        text = (a / unit).read_text()
        assert not re.search(r"@[A-Z]+@", text)     # every placeholder filled in
        for key in ("Restart=on-failure", "LimitMEMLOCK=infinity",
                    "EnvironmentFile=/etc/strata-dist/strata.env"):
            assert key in text


def test_unit_command_lines_are_what_the_programs_accept(tmp_path):
    _, out = deploy(tmp_path, "--curve", "--no-remote-cross-host")
    env = env_of(out / "hostA" / "strata.env")
    rank = exec_start((out / "hostA" / "strata-rank@.service").read_text(), env, "1")
    assert rank[0] == os.path.join(os.path.dirname(sys.executable), "strata-rank")
    r = rank_parser().parse_args(rank[1:])
    assert (r.coordinator, r.device, r.host_id, r.reconnect) == ("tcp://hostA:5555", "cuda:1",
                                                                 "hostA", True)
    assert r.curve_keys == "/etc/strata-dist/curve" and r.model == "/models/M.gguf"
    head = exec_start((out / "hostA" / "strata-coordinator.service").read_text(), env)
    h = launch_parser().parse_args(head[1:])
    assert (h.listen, h.expect_ranks, h.port, h.no_remote_cross_host, h.rejoin) == \
        ("tcp://0.0.0.0:5555", 3, 8080, True, True)    # a lost rank's unit brings it back alone
    assert h.token_file == "/etc/strata-dist/token"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (.ci/run installs Debian's systemd)")
def test_generated_units_pass_systemd_analyze_verify(tmp_path):
    _, out = deploy(tmp_path, "--curve")
    d = out / "hostA"
    shutil.copy(d / "strata-rank@.service", d / "strata-rank@0.service")   # an instance of it
    units = [str(d / u) for u in ("strata-coordinator.service", "strata-rank@.service",
                                  "strata-rank@0.service")]
    r = subprocess.run(["systemd-analyze", "verify", *units], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == "", r.stderr     # not even a warning (unknown key, bad value)


def test_one_host_deploy_listens_on_loopback(tmp_path):
    out = tmp_path / "one"
    assert tools_main(["deploy", "systemd", "--coordinator", "box:5555", "--hosts", "box:0",
                       "--model", "/m.gguf", "--out", str(out), "--no-rejoin"]) == 0
    env = env_of(out / "box" / "strata.env")
    assert env["STRATA_LAUNCH_ARGS"] == "--port 8080"       # --no-rejoin: no --rejoin
    assert env["STRATA_LISTEN"] == "tcp://127.0.0.1:5555"
    assert env["STRATA_COORDINATOR"] == "tcp://127.0.0.1:5555" and env["STRATA_CURVE_ARGS"] == ""


def test_an_existing_secret_is_reused(tmp_path):
    token = tmp_path / "t"
    token.write_text("k" * 40 + "\n")
    code, out = deploy(tmp_path, "--token-file", str(token))
    assert code == 0 and (out / "hostB" / "token").read_text().strip() == "k" * 40


@pytest.mark.parametrize("args, says", [
    (["--coordinator", "hostA", "--hosts", "hostA:0"], "HOST:PORT"),
    (["--coordinator", "hostA:5555", "--hosts", "hostA"], "HOST:GPU"),
    (["--coordinator", "hostA:5555", "--hosts", "hostA:0,0"], "once"),
    (["--coordinator", "hostA:5555", "--hosts", "hostA:0", "hostA:1"], "twice"),
])
def test_deploy_refusals(tmp_path, capsys, args, says):
    assert tools_main(["deploy", "systemd", *args, "--model", "/m", "--out", str(tmp_path)]) == 2
    assert says in capsys.readouterr().err


def test_an_out_that_is_a_file_is_refused_naming_it(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("x")
    for out, says in ((taken, f"error: --out {taken} is a file: name a folder for the deployment"),
                      (taken / "sub", f"error: {taken / 'sub'}: Not a directory")):
        assert tools_main(["deploy", "systemd", "--coordinator", "hostA:5555", "--hosts",
                           "hostA:0", "--model", "/m", "--out", str(out)]) == 2
        assert capsys.readouterr().err.strip() == says


def test_strata_dist_help_names_deploy(capsys):
    assert tools_main(["--help"]) == 0
    assert "deploy" in capsys.readouterr().out
    assert parse_hosts(["a:0,1", "b:2"]) == [("a", [0, 1]), ("b", [2])]


def test_a_calibration_is_installed_on_the_coordinator_which_plans_with_it(tmp_path, capsys):
    from strata_dist.tools.calibrate import FORMAT, save_calibration
    cal = tmp_path / "cal.json"
    save_calibration({"strata_calibration": FORMAT, "params": {"link_ms": 0.4, "link_gbs": 2.0},
                      "measured": {}}, str(cal))
    code, out = deploy(tmp_path, "--calibration", str(cal))
    assert code == 0
    a, b = out / "hostA", out / "hostB"
    assert (a / "calibration.json").read_text() == cal.read_text()
    assert "calibration.json" not in os.listdir(b)
    assert 'install -m 0644 calibration.json "$ETC/calibration.json"' in (a / "install.sh").read_text()
    env = env_of(a / "strata.env")
    head = exec_start((a / "strata-coordinator.service").read_text(), env)
    assert launch_parser().parse_args(head[1:]).calibration == "/etc/strata-dist/calibration.json"
    bad = tmp_path / "bad.json"
    bad.write_text('{"strata_calibration": 1, "params": {"link_gbs": -2}}')
    code, _ = deploy(tmp_path, "--calibration", str(bad))
    assert code == 2 and f"calibration {bad}" in capsys.readouterr().err
