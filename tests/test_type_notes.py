"""What a GPU rank keeps of each stored type (backends/layout.py): every block type of the kernels'
type table is priced and loaded as stored (the planner and the loader share dense_nbytes), and a
tensor of a type no kernel reads is named at load with its cost, never silently slow."""
import numpy as np
from gguf import GGMLQuantizationType as QT, GGML_QUANT_SIZES, GGUFWriter

from strata_dist.backends.layout import (GPU_NATIVE_QUANTS, dense_nbytes, dense_type_note,
                                         expert_type_notes)
from strata_dist.gguf_file.reader import GGUFModel
from strata_dist.kernels.abi import KERNEL_TYPES
from type_rows import ALL_TYPES

N_EXPERT, N_EMBD, N_FF = 4, 256, 256


def _raw(qtype, shape, seed: int) -> np.ndarray:
    """Stored bytes of `shape` (last dimension the row) in qtype (random: only sizes and types
    are read here)."""
    block, size = GGML_QUANT_SIZES[qtype]
    rows = int(np.prod(shape[:-1]))
    raw = np.random.default_rng(seed).integers(0, 256, (rows, shape[-1] // block, size), np.uint8)
    return raw.reshape(*shape[:-1], shape[-1] // block * size)


def _file(tmp_path, types: dict[str, QT]) -> GGUFModel:
    w = GGUFWriter(str(tmp_path / "types.gguf"), "qwen3moe")
    for i, (name, qtype) in enumerate(types.items()):
        shape = (N_EXPERT, N_FF, N_EMBD) if "exps" in name else (N_FF, N_EMBD)
        w.add_tensor(name, _raw(qtype, shape, i), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFModel(str(tmp_path / "types.gguf"))


def test_every_block_type_of_the_kernels_is_priced_as_stored(tmp_path):
    block_types = [t for t in ALL_TYPES if t not in (QT.F32, QT.F16)]
    assert set(block_types) == GPU_NATIVE_QUANTS == {QT(t) for t in KERNEL_TYPES} - {QT.F32, QT.F16}
    g = _file(tmp_path, {f"blk.{i}.attn_q.weight": t for i, t in enumerate(block_types)})
    for i, t in enumerate(block_types):
        info = g.tensor(f"blk.{i}.attn_q.weight")
        assert dense_nbytes(info, "cuda", False) == info.n_bytes, t.name
        assert dense_nbytes(info, "cpu", False) == 4 * N_FF * N_EMBD
        assert dense_type_note(info) is None, t.name


def test_a_type_without_a_kernel_is_named_with_its_cost(tmp_path):
    g = _file(tmp_path, {"blk.0.attn_q.weight": QT.TQ2_0, "blk.0.attn_k.weight": QT.Q4_0,
                         "blk.0.ffn_gate_exps.weight": QT.TQ2_0,
                         "blk.0.ffn_up_exps.weight": QT.TQ2_0,
                         "blk.0.ffn_down_exps.weight": QT.Q6_K,
                         "blk.1.ffn_gate_exps.weight": QT.Q2_K, "blk.1.ffn_up_exps.weight": QT.Q2_K,
                         "blk.1.ffn_down_exps.weight": QT.Q3_K})
    q = g.tensor("blk.0.attn_q.weight")
    assert dense_nbytes(q, "cuda", False) == 2 * N_FF * N_EMBD          # decoded to f16
    # TQ2_0 (ternary): 66 bytes a 256 weights, so its f16 copy is 512 / 66 = 7.8 times the bytes
    assert dense_type_note(q) == "blk.0.attn_q.weight: TQ2_0 read as f16, 7.8x the bytes"
    assert dense_type_note(g.tensor("blk.0.attn_k.weight")) is None
    notes = expert_type_notes(g, 0)
    assert len(notes) == 2 and all("has no GPU kernel" in n and "15.5x the bytes" in n
                                   for n in notes), notes
    assert notes[0].startswith("blk.0.ffn_gate_exps.weight: TQ2_0")
    assert notes[1].startswith("blk.0.ffn_up_exps.weight: TQ2_0")
    assert expert_type_notes(g, 1) == [] and expert_type_notes(g, 7) == []
