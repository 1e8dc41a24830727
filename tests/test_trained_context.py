"""strata-launch's --max-context against the context a file says its model was trained for
(`<arch>.context_length`, or under yarn factor x original_context_length): unset, the default is
capped to it; asked past it, the launch goes on with a warning naming the trained length."""
import dataclasses
import json
import subprocess
import sys

import pytest

from strata_dist.synth import GEOMETRIES, write_synthetic

TIMEOUT = 60


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """tiny with a 1,024-token context; and a file whose context_length says 512 while its yarn
    keys stretch x4 over 512 (trained 2,048: the longer of the two)."""
    from gguf import GGUFValueType

    from hf_fixtures import tiny_qwen3moe, write_gguf
    root = tmp_path_factory.mktemp("ctx")
    short = dataclasses.replace(GEOMETRIES["tiny"], name="tiny-1k", context_length=1024)
    out = {"plain": str(root / "plain.gguf"), "yarn": str(root / "yarn.gguf")}
    write_synthetic(out["plain"], like=short, quant="f32")
    hf = tiny_qwen3moe(3, hidden=64, top_k=2, n_layers=1)
    hf.config.max_position_embeddings = 512      # the file's context_length
    write_gguf(hf, out["yarn"], "f32", metadata={
        "rope.scaling.type": ("yarn", GGUFValueType.STRING),
        "rope.scaling.factor": (4.0, GGUFValueType.FLOAT32),
        "rope.scaling.original_context_length": (512, GGUFValueType.UINT32)})
    return out


def plan(model: str, *args: str) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "--model", model, "--cpu-ranks",
                           "1", "--plan-only", "--json", *args],
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


@pytest.mark.parametrize("name,trained", [("plain", 1024), ("yarn", 2048)])
def test_the_default_is_capped_at_the_trained_context(files, name, trained):
    got, err = plan(files[name])
    assert got["cells"] == trained
    assert "--max-context" not in err


@pytest.mark.parametrize("name,trained,how", [
    ("plain", 1024, ""), ("yarn", 2048, " (rope scaling yarn x4 over 512)")])
def test_asking_past_the_trained_context_warns_naming_it(files, name, trained, how):
    got, err = plan(files[name], "--max-context", str(trained))     # up to it: granted quietly
    assert got["cells"] == trained and "--max-context" not in err
    got, err = plan(files[name], "--max-context", "8192")
    assert got["cells"] == 8192
    warning = [line for line in err.splitlines() if "--max-context" in line]
    assert warning == [f"warning: --max-context 8192 is past the {trained} positions {name}.gguf "
                       f"was trained for{how}: output past {trained} tokens may degrade"], err

