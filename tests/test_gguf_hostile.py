"""Hostile GGUF files against every entry point (`strata-dist generate`, `strata-launch
--plan-only`, and a launch whose rank loads the weights): an array or string longer than the file,
counts no file could hold, arrays nested thousands deep, strings that are not UTF-8, NaN/Inf
weights, and tensor offsets that are misaligned, overlap or leave gaps. Each is refused with one
`error:` line naming the file and the key or tensor, exit 2, within 10 s and 500 MB."""
import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from bounded_run import bounded, refused_in_bounds
from strata_dist.gguf_file.reader import GGUFModel


def every_entry_point(path, *needles, load=False):
    """generate, the launcher's plan, and (load=True: a problem found when weights are read) a
    launch whose one CPU rank loads the model."""
    refused_in_bounds(bounded("-m", "strata_dist.tools.cli", "generate", "--model", str(path),
                              "--max-new", "2"), *needles)
    launch = ["-m", "launcher.cli", "--model", str(path), "--cpu-ranks", "1"]
    if load:
        # the rank refuses (exit 2) and the launcher reports its line, with its status
        refused_in_bounds(bounded(*launch, "--prompt-ids", "1,2,3", "--max-new", "2"), *needles)
    else:
        refused_in_bounds(bounded(*launch, "--plan-only"), *needles)


# ---- the header ----------------------------------------------------------------------------------

def _string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def _header(n_tensors: int, kvs: bytes, n_kv: int = 1) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kvs


def test_an_array_of_2_62_bytes_in_a_49_byte_file(tmp_path):
    bomb = _header(0, _string(b"a") + struct.pack("<IIQ", VT.ARRAY, VT.UINT8, 1 << 62))
    assert len(bomb) == 49
    path = tmp_path / "bomb.gguf"
    path.write_bytes(bomb)
    every_entry_point(path, str(path), "key 'a'", "array of 4611686018427387904 UINT8")


def test_a_string_array_longer_than_the_file(tmp_path):
    path = tmp_path / "strings.gguf"
    path.write_bytes(_header(0, _string(b"tokenizer.ggml.tokens")
                             + struct.pack("<IIQ", VT.ARRAY, VT.STRING, 1 << 40) + bytes(64)))
    every_entry_point(path, str(path), "key 'tokenizer.ggml.tokens'")


def test_a_string_longer_than_the_file(tmp_path):
    path = tmp_path / "long.gguf"
    path.write_bytes(_header(0, _string(b"general.architecture") + struct.pack("<I", VT.STRING)
                             + struct.pack("<Q", 1 << 62) + b"qwen3moe"))
    every_entry_point(path, str(path), "key 'general.architecture'", "declares")


def test_arrays_nested_5000_deep(tmp_path):
    path = tmp_path / "nested.gguf"
    level = struct.pack("<IQ", VT.ARRAY, 1)
    path.write_bytes(_header(0, _string(b"deep") + struct.pack("<I", VT.ARRAY) + level * 5000
                             + struct.pack("<IQ", VT.UINT8, 1) + b"\0"))
    every_entry_point(path, str(path), "key 'deep'", "nested")


@pytest.mark.parametrize("n_tensors,n_kv", [(1 << 60, 0), (0, 1 << 60), (1 << 40, 1 << 40)])
def test_counts_no_file_of_its_size_could_hold(tmp_path, n_tensors, n_kv):
    path = tmp_path / "counts.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + bytes(64))
    every_entry_point(path, str(path), f"declares {n_kv} keys and {n_tensors} tensors")


def test_more_keys_than_any_model_has_in_a_file_that_could_hold_them(tmp_path):
    path = tmp_path / "keys.gguf"
    n = 70_000
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, n) + bytes(13 * n))
    every_entry_point(path, str(path), f"declares {n} keys", "at most 65536 keys")


def test_a_string_array_of_more_entries_than_any_vocabulary(tmp_path):
    path = tmp_path / "vocab.gguf"
    n = (1 << 22) + 1
    path.write_bytes(_header(0, _string(b"tokenizer.ggml.merges")
                             + struct.pack("<IIQ", VT.ARRAY, VT.STRING, n) + bytes(8 * n)))
    every_entry_point(path, str(path), "key 'tokenizer.ggml.merges'", f"array of {n} strings")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from strata_dist.synth import write_synthetic
    path = tmp_path_factory.mktemp("gguf_hostile") / "m.gguf"
    write_synthetic(path, like="tiny", quant="f32", popularity="zipf:1.0", seed=0)
    return path


@pytest.fixture(scope="module")
def q8_model(tmp_path_factory):
    from strata_dist.synth import write_synthetic
    path = tmp_path_factory.mktemp("gguf_hostile") / "q8.gguf"
    write_synthetic(path, like="tiny", quant="q8_0", popularity="zipf:1.0", seed=0)
    return path


def _patched(src, dst, edits: list[tuple[int, bytes]]):
    data = bytearray(src.read_bytes())
    for at, new in edits:
        data[at: at + len(new)] = new
    dst.write_bytes(bytes(data))
    return dst


def _string_value_at(data: bytes, key: str) -> int:
    """Where the value bytes of the string key `key` start (after its type and length)."""
    return data.index(_string(key.encode())) + 8 + len(key) + 4 + 8


def test_an_architecture_that_is_not_utf8(model, tmp_path):
    at = _string_value_at(model.read_bytes(), "general.architecture")
    bad = _patched(model, tmp_path / "arch.gguf", [(at + 3, b"\xff")])
    every_entry_point(bad, str(bad), "key 'general.architecture'", "not valid UTF-8")


def test_a_tokenizer_string_that_is_not_utf8(model, tmp_path):
    at = _string_value_at(model.read_bytes(), "tokenizer.ggml.pre")
    bad = _patched(model, tmp_path / "pre.gguf", [(at, b"\xc3\x28")])
    refused_in_bounds(bounded("-m", "strata_dist.tools.cli", "generate", "--model", str(bad),
                              "--prompt", "hello", "--max-new", "2"),
                      str(bad), "key 'tokenizer.ggml.pre'", "not valid UTF-8")
    refused_in_bounds(bounded("-m", "launcher.cli", "--model", str(bad), "--cpu-ranks", "1",
                              "--plan-only", "--prompt", "hello"),
                      str(bad), "key 'tokenizer.ggml.pre'", "not valid UTF-8")


def test_a_token_that_is_not_utf8(model, tmp_path):
    data = model.read_bytes()
    table = data.index(_string(b"tokenizer.ggml.tokens"))
    first = table + 8 + len(b"tokenizer.ggml.tokens") + 4 + 4 + 8   # type, element type, count
    n = struct.unpack_from("<Q", data, first)[0]
    second = first + 8 + n                                          # token 1's length
    bad = _patched(model, tmp_path / "token.gguf", [(second + 8, b"\xff")])
    refused_in_bounds(bounded("-m", "strata_dist.tools.cli", "generate", "--model", str(bad),
                              "--prompt", "hello", "--max-new", "2"),
                      str(bad), "key 'tokenizer.ggml.tokens'", "entry 1", "not valid UTF-8")


# ---- weights -------------------------------------------------------------------------------------

def _tensor_at(path, name: str, element: int = 0) -> int:
    info = GGUFModel(path).tensor(name)
    return info.offset + element


@pytest.mark.parametrize("name,element,bits,needle", [
    ("blk.3.attn_q.weight", 4 * 70, struct.pack("<f", float("nan")), "NaN at element 70 (row 1)"),
    ("blk.1.ffn_norm.weight", 4 * 5, struct.pack("<f", float("inf")), "Inf at element 5"),
])
def test_nan_and_inf_weights_are_refused_at_load(model, tmp_path, name, element, bits, needle):
    bad = _patched(model, tmp_path / "nan.gguf", [(_tensor_at(model, name, element), bits)])
    every_entry_point(bad, str(bad), f"tensor '{name}'", needle, load=True)


def test_inf_in_the_experts_is_refused_before_an_expert_is_used(model, tmp_path):
    # -Inf at the same place of every expert of layer 2: whichever the router picks first (a
    # process that reads experts as they are used checks each one on its first read)
    name = "blk.2.ffn_down_exps.weight"
    info = GGUFModel(model).tensor(name)
    per_expert = info.n_bytes // info.shape[0]
    bad = _patched(model, tmp_path / "inf.gguf",
                   [(info.offset + e * per_expert + 4 * 808, struct.pack("<f", float("-inf")))
                    for e in range(info.shape[0])])
    every_entry_point(bad, str(bad), f"tensor '{name}'", "Inf at element 808 (row 25)", load=True)


def test_nan_in_a_quantized_block_scale(q8_model, tmp_path):
    # Q8_0 blocks are 34 bytes, an f16 scale first: block 5 of each layer-1 expert
    name = "blk.1.ffn_up_exps.weight"
    at = _tensor_at(q8_model, name, 34 * 5)
    info = GGUFModel(q8_model).tensor(name)
    per_expert = info.n_bytes // info.shape[0]
    bad = _patched(q8_model, tmp_path / "q8nan.gguf",
                   [(at + e * per_expert, np.float16("nan").tobytes())
                    for e in range(info.shape[0])])
    every_entry_point(bad, str(bad), f"tensor '{name}'", "NaN in the scale of block 5 (row 2)",
                      load=True)


def test_f16_inf_in_a_dense_tensor(tmp_path):
    from hf_fixtures import tiny_qwen3moe, write_gguf
    f16 = Path(write_gguf(tiny_qwen3moe(0), tmp_path / "f16.gguf", "f16"))
    name = "blk.0.attn_k.weight"
    assert GGUFModel(f16).tensor(name).ggml_type == QT.F16
    bad = _patched(f16, tmp_path / "f16inf.gguf",
                   [(_tensor_at(f16, name, 2 * 77), np.float16("inf").tobytes())])
    every_entry_point(bad, str(bad), f"tensor '{name}'", "Inf at element 77", load=True)


# ---- tensor layout -------------------------------------------------------------------------------

def _tensor_info_at(data: bytes, name: str) -> tuple[int, int]:
    """(where the type field of tensor `name`'s table entry is, where its offset field is)."""
    at = data.index(_string(name.encode()))
    at += 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    type_at = at + 4 + 8 * n_dims
    return type_at, type_at + 4


def _relative_offset(data: bytes, name: str) -> int:
    return struct.unpack_from("<Q", data, _tensor_info_at(data, name)[1])[0]


def test_a_misaligned_offset(model, tmp_path):
    data = model.read_bytes()
    name = "blk.1.attn_k.weight"
    _, off = _tensor_info_at(data, name)
    bad = _patched(model, tmp_path / "misaligned.gguf",
                   [(off, struct.pack("<Q", _relative_offset(data, name) + 4))])
    every_entry_point(bad, str(bad), f"tensor '{name}'", "not a multiple of the alignment 32")


def test_overlapping_offsets(model, tmp_path):
    data = model.read_bytes()
    _, off = _tensor_info_at(data, "blk.2.attn_v.weight")
    bad = _patched(model, tmp_path / "overlap.gguf",
                   [(off, struct.pack("<Q", _relative_offset(data, "blk.2.attn_k.weight")))])
    every_entry_point(bad, str(bad), "overlaps tensor", "blk.2.attn_k.weight",
                      "blk.2.attn_v.weight")


@pytest.mark.parametrize("new_type,needle", [(QT.F16, "a gap of"), (QT.F64, "overlaps tensor")])
def test_a_declared_type_whose_size_does_not_match_the_layout(model, tmp_path, new_type, needle):
    # F32 data declared F16 leaves half its bytes unaccounted for; declared F64, it runs into
    # the next tensor
    data = model.read_bytes()
    name = "blk.1.attn_q.weight"
    type_at, _ = _tensor_info_at(data, name)
    bad = _patched(model, tmp_path / "type.gguf", [(type_at, struct.pack("<I", new_type))])
    every_entry_point(bad, str(bad), needle, name)


def test_the_checked_files_still_load(model, q8_model):
    """The synth's files pass every check: the refusals above come from the damage alone."""
    for path in (model, q8_model):
        m = GGUFModel(path)
        for name in m.tensors:
            m.raw(name)
        assert m.expert_blob(3, 7).size > 0
