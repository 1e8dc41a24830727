"""Routing profiles: recording through the real forward, the file format, the prompt-ids file, the CLI,
and the synthetic models' popularity law as the forward actually routes it."""
from __future__ import annotations

import json
import subprocess
import sys
import warnings

import numpy as np
import pytest

from strata_dist.tools.single_process import SingleProcessRunner
from strata_dist.gguf_file.reader import GGUFModel
from strata_dist.plan.profile import RoutingProfile
from strata_dist.tools.profile_io import (load_profile, read_profile_file, read_prompt_ids_file, record_profile,
                                    save_profile, tokens_routed)
from strata_dist.synth import GEOMETRIES, parse_popularity, write_synthetic

TINY = GEOMETRIES["tiny"]
L, E, K = TINY.n_layer, TINY.n_expert, TINY.n_expert_used


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("profile-models")
    out = {}
    for pop in ("zipf:1.0", "uniform"):
        path = d / f"tiny-{pop.replace(':', '')}.gguf"
        write_synthetic(path, like="tiny", quant="f32", popularity=pop, seed=0)
        out[pop] = path
    return out


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, TINY.n_vocab, length).tolist() for _ in range(n)]


# ---------------------------------------------------------------- recording
def test_counts_sum_to_tokens_layers_topk(models):
    prompts = [[1, 2, 3], list(range(10, 27)), [500] * 5]
    prof = record_profile(models["zipf:1.0"], prompts)
    n_tok = sum(len(p) for p in prompts)
    assert prof.counts.shape == (L, E)
    assert prof.counts.sum() == n_tok * L * K
    np.testing.assert_array_equal(prof.counts.sum(axis=1), np.full(L, n_tok * K))
    assert np.all(prof.counts == np.round(prof.counts))
    assert tokens_routed(prof, K) == n_tok
    # the prompt chunk changes nothing: every token is routed exactly once per layer either way
    assert record_profile(models["zipf:1.0"], prompts, prompt_chunk=4) == prof


def test_decode_steps_are_counted(models):
    prompts = _prompts(3, 7, seed=3)
    max_new = 5
    prof = record_profile(models["uniform"], prompts, max_new=max_new)
    eng = SingleProcessRunner(str(models["uniform"]), max_context=64)
    fed = sum(len(p) + len(eng.generate(p, max_new).tokens) - 1 for p in prompts)  # last token is not fed
    assert fed > sum(len(p) for p in prompts)
    np.testing.assert_array_equal(prof.counts.sum(axis=1), np.full(L, fed * K))


def test_record_refuses_bad_prompts(models):
    with pytest.raises(ValueError, match="no prompts"):
        record_profile(models["uniform"], [])
    with pytest.raises(ValueError, match="prompt 2 is empty"):
        record_profile(models["uniform"], [[1], []])
    with pytest.raises(ValueError, match=r"prompt 2: token id 512 is out of range \[0, 512\)"):
        record_profile(models["uniform"], [[1], [3, 512]])


# ---------------------------------------------------------------- files
def test_save_load_round_trip(tmp_path, models):
    prof = record_profile(models["zipf:1.0"], _prompts(2, 9))
    fp = GGUFModel(str(models["zipf:1.0"])).fingerprint
    path = tmp_path / "p.json"
    save_profile(prof, path, model_fingerprint=fp, meta={"prompts": 2})
    assert load_profile(path, L, E) == prof
    again, fp_read, meta = read_profile_file(path)
    assert again == prof and fp_read == fp and meta == {"prompts": 2}
    doc = json.loads(path.read_text())
    assert doc["format"] == "strata-routing-profile" and doc["version"] == 1
    assert (doc["n_layers"], doc["n_experts"]) == (L, E)
    assert all(isinstance(x, int) for row in doc["counts"] for x in row)
    # non-integer counts survive too, and the binary form of RoutingProfile.to_bytes loads
    frac = RoutingProfile(prof.counts + 0.25)
    save_profile(frac, tmp_path / "f.json")
    assert load_profile(tmp_path / "f.json", L, E) == frac
    (tmp_path / "p.bin").write_bytes(prof.to_bytes())
    assert load_profile(tmp_path / "p.bin", L, E) == prof
    # a different model file of the same shape: loaded, with a warning
    with pytest.warns(UserWarning, match="recorded on model"):
        assert load_profile(path, L, E, model_fingerprint="0" * 16) == prof
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_profile(path, L, E, model_fingerprint=fp)


def test_shape_mismatch_names_both_shapes(tmp_path):
    path = tmp_path / "p.json"
    save_profile(RoutingProfile(np.ones((4, 8))), path)
    with pytest.raises(ValueError, match=r"p\.json.*\[4 layers, 8 experts\].*\[48, 128\]"):
        load_profile(path, 48, 128)
    (tmp_path / "p.bin").write_bytes(RoutingProfile(np.ones((4, 8))).to_bytes())
    with pytest.raises(ValueError, match=r"\[4 layers, 8 experts\].*\[4, 16\]"):
        load_profile(tmp_path / "p.bin", 4, 16)


@pytest.mark.parametrize("content", [
    b"not json at all",
    b"\xff\xfe\x00garbage",
    b"[1, 2, 3]",
    b'{"format": "something-else", "version": 1}',
    b'{"format": "strata-routing-profile", "version": 9, "n_layers": 1, "n_experts": 2, "counts": [[1, 2]]}',
    b'{"format": "strata-routing-profile", "version": 1, "n_layers": 2, "n_experts": 2, "counts": [[1, 2]]}',
    b'{"format": "strata-routing-profile", "version": 1, "n_layers": 1, "n_experts": 2, "counts": [[1, 2, 3]]}',
    b'{"format": "strata-routing-profile", "version": 1, "n_layers": 1, "n_experts": 2, "counts": [[1, -2]]}',
    b'{"format": "strata-routing-profile", "version": 1, "n_layers": 1, "n_experts": 2, "counts": [[1, "x"]]}',
    b"STRPROF1\x01\x00\x00\x00\x02\x00\x00\x00short",
])
def test_malformed_file_names_the_file(tmp_path, content):
    path = tmp_path / "broken-profile.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="broken-profile.json"):
        load_profile(path, 1, 2)


def test_missing_file_names_the_file(tmp_path):
    with pytest.raises(ValueError, match="nope.json"):
        load_profile(tmp_path / "nope.json", 1, 2)


# ---------------------------------------------------------------- prompt ids file
def test_read_prompt_ids_file(tmp_path):
    f = tmp_path / "ids.txt"
    f.write_text("# a comment\n1,2,3\n\n   \n4 5  6\n7, 8,9,   # trailing comment\n  10\n")
    assert read_prompt_ids_file(f) == [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10]]


@pytest.mark.parametrize("bad, lineno", [("1,2\n3,x\n", 2), ("# c\n\n1 2\n-4\n", 4), ("1\n2\n3.5\n", 3)])
def test_read_prompt_ids_file_bad_line(tmp_path, bad, lineno):
    f = tmp_path / "ids.txt"
    f.write_text(bad)
    with pytest.raises(ValueError, match=rf"ids\.txt:{lineno}:"):
        read_prompt_ids_file(f)


def test_read_prompt_ids_file_empty_or_missing(tmp_path):
    f = tmp_path / "ids.txt"
    f.write_text("# only a comment\n\n")
    with pytest.raises(ValueError, match="no prompts"):
        read_prompt_ids_file(f)
    with pytest.raises(ValueError, match="missing.txt"):
        read_prompt_ids_file(tmp_path / "missing.txt")


# ---------------------------------------------------------------- CLI
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strata_dist.tools.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_cli_profile_end_to_end(tmp_path, models):
    ids = tmp_path / "ids.txt"
    ids.write_text("# two prompts\n1,2,3,4\n5 6 7 8 9 10\n")
    out = tmp_path / "prof.json"
    r = _cli("profile", "--model", models["zipf:1.0"], "--prompt-ids-file", ids, "--out", out,
             "--max-new", "2", "--prefill", "3")
    assert r.returncode == 0, r.stderr
    assert "tokens routed" in r.stdout and "top pair" in r.stdout
    prof = load_profile(out, L, E, model_fingerprint=GGUFModel(str(models["zipf:1.0"])).fingerprint)
    assert prof.counts.sum() > 0
    # the same run through the library gives the same counts
    assert prof == record_profile(models["zipf:1.0"], [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10]], max_new=2)


def test_cli_profile_bad_ids_file_exits_2(tmp_path, models):
    ids = tmp_path / "ids.txt"
    ids.write_text("1,2,3\n# fine\nfour,5\n")
    r = _cli("profile", "--model", models["uniform"], "--prompt-ids-file", ids, "--out", tmp_path / "p.json")
    assert r.returncode == 2
    assert "ids.txt:3:" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "p.json").exists()
    ids.write_text("1,2,3\n7,999\n")  # id past the tiny vocabulary of 512
    r = _cli("profile", "--model", models["uniform"], "--prompt-ids-file", ids, "--out", tmp_path / "p.json")
    assert r.returncode == 2 and "prompt 2" in r.stderr and "Traceback" not in r.stderr


# ---------------------------------------------------------------- synth popularity, through the forward
def _top_quarter_share(prof: RoutingProfile) -> float:
    """Share of each layer's routing held by its hottest quarter of experts, averaged over layers."""
    per_layer = prof.mass() * prof.n_layers
    q = max(1, prof.n_experts // 4)
    return float(np.mean(np.sort(per_layer, axis=1)[:, ::-1][:, :q].sum(axis=1)))


def test_synth_popularity_shows_in_the_recorded_profile(models):
    prompts = _prompts(20, 32)
    zipf = record_profile(models["zipf:1.0"], prompts)
    uniform = record_profile(models["uniform"], prompts)
    z, u = _top_quarter_share(zipf), _top_quarter_share(uniform)
    assert z > 0.45, f"zipf:1.0 top-25% share {z:.3f}"
    assert u < 0.35, f"uniform top-25% share {u:.3f}"
    # and the hot experts are the ones the file says: the recorded share of each popularity rank
    # (strata.synth.expert_rank, hottest first per layer) follows the target law
    ranks = np.asarray(GGUFModel(str(models["zipf:1.0"])).metadata_array("strata.synth.expert_rank"))
    by_rank = np.take_along_axis(zipf.mass() * L, ranks.reshape(L, E), axis=1)
    target = parse_popularity("zipf:1.0").shares(E)
    np.testing.assert_allclose(by_rank.mean(axis=0), target, atol=0.03)
