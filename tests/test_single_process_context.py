"""`strata-dist generate` and `logits` size their session by the launcher's rule: --max-context
unset is 4096 capped at the context the file says the model was trained for (context_length, or
under yarn factor x original_context_length); asked past it, granted with the launcher's warning
naming the trained length; below 1, one `error:` line (exit 2)."""
import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from strata_dist.tools.single_process import SingleProcessRunner
from strata_dist.synth import GEOMETRIES, write_synthetic

TIMEOUT = 60


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """tiny trained to 1,024 and to 8,192 positions; and a file whose context_length says 512
    while its yarn keys stretch x4 over 512 (trained 2,048)."""
    from gguf import GGUFValueType

    from hf_fixtures import tiny_qwen3moe, write_gguf
    root = tmp_path_factory.mktemp("spctx")
    out = {"plain": str(root / "plain.gguf"), "long": str(root / "long.gguf"),
           "yarn": str(root / "yarn.gguf")}
    for name, ctx in (("plain", 1024), ("long", 8192)):
        write_synthetic(out[name], like=dataclasses.replace(GEOMETRIES["tiny"], name=name,
                                                            context_length=ctx), quant="f32")
    hf = tiny_qwen3moe(3, hidden=64, top_k=2, n_layers=1)
    hf.config.max_position_embeddings = 512      # the file's context_length
    write_gguf(hf, out["yarn"], "f32", metadata={
        "rope.scaling.type": ("yarn", GGUFValueType.STRING),
        "rope.scaling.factor": (4.0, GGUFValueType.FLOAT32),
        "rope.scaling.original_context_length": (512, GGUFValueType.UINT32)})
    return out


def tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strata_dist.tools.cli", *args], capture_output=True,
                          text=True, timeout=TIMEOUT)


@pytest.mark.parametrize("name,cells", [("plain", 1024), ("long", 4096), ("yarn", 2048)])
def test_the_default_is_4096_capped_at_the_trained_context(files, name, cells):
    assert SingleProcessRunner(files[name]).max_context == cells


@pytest.mark.parametrize("name,trained,how", [
    ("plain", 1024, ""), ("yarn", 2048, " (rope scaling yarn x4 over 512)")])
def test_asking_past_the_trained_context_is_granted_with_the_launchers_warning(
        files, name, trained, how, tmp_path):
    warned = []
    assert SingleProcessRunner(files[name], max_context=trained, warn=warned.append).max_context \
        == trained and warned == []                   # up to it: granted quietly
    ids = ",".join(str(3 + i % 50) for i in range(1100))   # past 1,024 positions
    for cmd in (["generate", "--prompt-ids", ids, "--max-new", "2"],
                ["logits", "--tokens", ids, "--out", str(tmp_path / "l.npy")]):
        proc = tool(*cmd, "--model", files[name], "--max-context", "8192")
        assert proc.returncode == 0, proc.stderr
        warning = [line for line in proc.stderr.splitlines() if "--max-context" in line]
        assert warning == [f"warning: --max-context 8192 is past the {trained} positions "
                           f"{name}.gguf was trained for{how}: output past {trained} tokens "
                           f"may degrade"], proc.stderr
    assert np.load(tmp_path / "l.npy").shape[0] == 1100


@pytest.mark.parametrize("value", ["0", "-5"])
def test_a_context_below_one_is_one_error_line(files, value):
    proc = tool("generate", "--model", files["plain"], "--max-context", value)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: --max-context must be >= 1, got {value}", proc.stderr


def test_generation_past_the_context_stops_at_its_end_with_the_tokens_made(files):
    """--max-new past the room the context leaves yields the tokens that fit (stop=length, as the
    pipeline's head bounds a request), not an error after the work; a prompt past the context is
    one error line naming both counts."""
    ids = ",".join(str(3 + i) for i in range(10))
    asked = tool("generate", "--model", files["plain"], "--prompt-ids", ids,
                 "--max-context", "40", "--max-new", "500")
    assert asked.returncode == 0, asked.stderr
    assert "30 generated" in asked.stderr and "stop=length" in asked.stderr, asked.stderr
    fits = tool("generate", "--model", files["plain"], "--prompt-ids", ids,
                "--max-context", "40", "--max-new", "30")
    assert asked.stdout == fits.stdout and len(fits.stdout.split(",")) == 30
    too_long = tool("generate", "--model", files["plain"], "--prompt-ids", ids, "--max-context", "8")
    assert too_long.returncode == 2
    assert too_long.stderr.strip() == ("error: the prompt has 10 tokens; the context holds 8 "
                                       "(--max-context)"), too_long.stderr
