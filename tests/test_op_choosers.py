"""The ops' choosers (strata_dist/ops/) say once why a path a compute option chose gave way: here
the MoE op's row kernels (ops/moe.py), refusing a layer whose expert rows they cannot read, with
the reason in the log once and the layout remembered (the general path runs those experts). No
GPU needed: the layout is read from the file."""
import logging

from hf_fixtures import tiny_qwen3moe, write_gguf
from strata_dist.compute_options import fall_back
from strata_dist.gguf_file.reader import GGUFModel
from strata_dist.ops import moe


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "strata.compute"]


def test_the_row_kernels_say_once_why_they_refuse_a_layer(tmp_path, caplog):
    # 48 columns in, 24 out: not whole 32-column steps of the row kernels (kernels/abi.py
    # ROWS_TILE_K); 64 in, 32 out: readable
    narrow = GGUFModel(write_gguf(tiny_qwen3moe(3, hidden=48, n_layers=2), tmp_path / "n.gguf"))
    wide = GGUFModel(write_gguf(tiny_qwen3moe(3, hidden=64, n_layers=2), tmp_path / "w.gguf"))
    assert moe.layout_refusal(wide, 0) == "" and moe.layer_experts(wide, 0) is not None
    why = moe.layout_refusal(narrow, 0)
    assert why == "experts of 48 -> 24 columns (the row kernels take multiples of 32)"
    fall_back.cache_clear()                    # said once per process: this test's first
    rows = moe.RowsKernels(0, mma=False)
    with caplog.at_level(logging.WARNING, logger="strata.compute"):
        assert rows.layout(wide, 0) is not None and _warnings(caplog) == []
        assert rows.layout(narrow, 0) is None and rows.layout(narrow, 1) is None
        assert rows.layout(narrow, 0) is None
    assert _warnings(caplog) == [f"{moe.ROWS_PATH} falls back: {why}"]

