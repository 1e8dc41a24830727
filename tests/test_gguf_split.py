"""A model published as shards (`m-00001-of-00003.gguf`, …) is one model: the same tensor index,
the same bytes, the same plan and the same tokens as the file unsplit, through `strata-dist
generate` and through a launch of two CPU ranks. A missing, extra or mismatched shard is refused at
start, naming the file and the key, exit 2."""
import shutil
import subprocess
import sys

import numpy as np
import pytest

from bounded_run import bounded, refused_in_bounds
from split_fixtures import set_split_key, split_gguf
from strata_dist.gguf_file.reader import GGUFModel

TIMEOUT = 120
PROMPT = ["--prompt-ids", "1,2,3,4,5", "--max-new", "8"]


@pytest.fixture(scope="module")
def unsplit(tmp_path_factory):
    from strata_dist.synth import write_synthetic
    path = tmp_path_factory.mktemp("unsplit") / "m.gguf"
    write_synthetic(path, like="tiny", quant="q8_0", popularity="zipf:1.0", seed=0)
    return path


@pytest.fixture(scope="module")
def shards(unsplit, tmp_path_factory):
    # 51 tensors, at most 20 a shard: 3 shards, layers and a layer's experts across shard edges
    return split_gguf(unsplit, tmp_path_factory.mktemp("split"), "m", max_tensors=20)


@pytest.fixture
def copy_of_shards(shards, tmp_path):
    """The shards in a folder of the test's own, to damage."""
    return [shutil.copy(p, tmp_path / p.name) for p in shards]


def run(module, *args):
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True,
                          text=True, timeout=TIMEOUT)


def test_the_shards_are_one_model(unsplit, shards):
    assert len(shards) == 3 and all(p.is_file() for p in shards)
    whole, split = GGUFModel(unsplit), GGUFModel(shards[0])
    assert split.shard_paths == [str(p) for p in shards] and whole.shard_paths == [str(unsplit)]
    assert split.file_bytes == sum(p.stat().st_size for p in shards)
    assert list(split.tensors) == list(whole.tensors)
    assert {t.shard for t in split.tensors.values()} == {0, 1, 2}
    for name, t in split.tensors.items():
        w = whole.tensors[name]
        assert (t.kind, t.layer, t.ggml_type, t.shape, t.n_bytes) == \
               (w.kind, w.layer, w.ggml_type, w.shape, w.n_bytes)
        assert t.file == str(shards[t.shard])
        np.testing.assert_array_equal(split.raw(name), whole.raw(name))
    for layer in range(4):
        for expert in (0, 7):
            np.testing.assert_array_equal(split.expert_blob(layer, expert),
                                          whole.expert_blob(layer, expert))
    for key in ("general.architecture", "qwen3moe.block_count", "tokenizer.ggml.model"):
        assert split.metadata(key) == whole.metadata(key)
    assert split.metadata_array("tokenizer.ggml.tokens") == \
           whole.metadata_array("tokenizer.ggml.tokens")
    # the fingerprint covers every shard's header: another split of the same model differs
    assert split.fingerprint != whole.fingerprint


def test_generate_reads_the_shards_as_the_file(unsplit, shards):
    whole = run("strata_dist.tools.cli", "generate", "--model", unsplit, *PROMPT)
    split = run("strata_dist.tools.cli", "generate", "--model", shards[0], *PROMPT)
    assert whole.returncode == 0 and split.returncode == 0, (whole.stderr, split.stderr)
    assert split.stdout == whole.stdout and len(whole.stdout.split(",")) == 8
    text = ["--prompt", "hello there", "--max-new", "6"]
    assert run("strata_dist.tools.cli", "generate", "--model", shards[0], *text).stdout == \
           run("strata_dist.tools.cli", "generate", "--model", unsplit, *text).stdout


def test_two_cpu_ranks_plan_and_generate_on_the_shards_as_on_the_file(unsplit, shards):
    stages = ["--cpu-ranks", "2", "--layer-split", "2"]
    plans = [run("launcher.cli", "--model", m, *stages, "--plan-only", "--json")
             for m in (unsplit, shards[0])]
    assert plans[0].returncode == 0 and plans[0].stdout == plans[1].stdout, plans[1].stderr
    outs = [run("launcher.cli", "--model", m, *stages, *PROMPT) for m in (unsplit, shards[0])]
    assert outs[1].returncode == 0, outs[1].stderr
    assert outs[1].stdout == outs[0].stdout and len(outs[0].stdout.split(",")) == 8


def refused_everywhere(first, *needles):
    refused_in_bounds(bounded("-m", "strata_dist.tools.cli", "generate", "--model", str(first),
                              "--max-new", "2"), *needles)
    refused_in_bounds(bounded("-m", "launcher.cli", "--model", str(first), "--cpu-ranks", "2",
                              "--plan-only"), *needles)


def test_a_missing_shard(copy_of_shards):
    copy_of_shards[1].unlink()
    refused_everywhere(copy_of_shards[0], f"{copy_of_shards[1]}: key 'split.count'",
                       "missing: shard 2 of 3")


def test_an_extra_shard(copy_of_shards):
    extra = copy_of_shards[0].parent / "m-00004-of-00003.gguf"
    shutil.copy(copy_of_shards[2], extra)
    refused_everywhere(copy_of_shards[0], f"{extra}: key 'split.count'", "extra shard")


@pytest.mark.parametrize("shard,key,value,needle", [
    (1, "split.count", 4, "is 4, expected 3"),
    (2, "split.no", 1, "is 1, expected 2 for shard 3 of 3 of"),
    (2, "split.no", 1, "this file holds shard 2 of its set; shards renamed or swapped?"),
    (1, "split.tensors.count", 50, "is 50, expected 51"),
])
def test_a_shard_whose_split_keys_disagree(copy_of_shards, shard, key, value, needle):
    set_split_key(copy_of_shards[shard], key, value)
    refused_everywhere(copy_of_shards[0], f"{copy_of_shards[shard]}: key '{key}'", needle)


def test_a_tensor_total_that_does_not_add_up(copy_of_shards):
    for p in copy_of_shards:
        set_split_key(p, "split.tensors.count", 52)
    refused_everywhere(copy_of_shards[0], f"{copy_of_shards[0]}: key 'split.tensors.count'",
                       "is 52 but the 3 shards hold 51 tensors")


def test_a_shard_that_is_not_the_first(copy_of_shards):
    refused_everywhere(copy_of_shards[1], f"{copy_of_shards[1]}: key 'split.no'",
                       "open the first shard")


def test_a_first_shard_renamed(copy_of_shards):
    renamed = copy_of_shards[0].parent / "model.gguf"
    copy_of_shards[0].rename(renamed)
    refused_everywhere(renamed, f"{renamed}: key 'split.count'", "not named")


def test_a_damaged_shard_is_named(copy_of_shards):
    data = bytearray(copy_of_shards[2].read_bytes())
    copy_of_shards[2].write_bytes(bytes(data[: len(data) - 100]))
    refused_everywhere(copy_of_shards[0], str(copy_of_shards[2]), "truncated")
