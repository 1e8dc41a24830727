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


def test_the_grouped_gate_up_is_chosen_by_the_switch_and_the_rows():
    """ops/moe.py grouped_gate_up: the default build never groups; the grouped build
    (KernelShape grouped_experts) groups steps of 2..MAX_ROWS rows, a one-row step (nothing to
    share: a row's top-k are distinct experts) keeps today's launch, and so does a top-k past what
    moe_group_pairs takes."""
    from strata_dist.kernels.abi import GROUP_MAX_K, MAX_ROWS, KernelShape
    off, on = KernelShape(), KernelShape.parse("grouped_experts=1")
    assert not any(moe.grouped_gate_up(off, n, 8) for n in range(1, MAX_ROWS + 1))
    assert [moe.grouped_gate_up(on, n, 8) for n in range(1, MAX_ROWS + 1)] == \
        [False] + [True] * (MAX_ROWS - 1)
    assert moe.grouped_gate_up(on, 3, GROUP_MAX_K) and not moe.grouped_gate_up(on, 3, GROUP_MAX_K + 1)


def test_the_grouped_down_is_chosen_by_its_switch_alone():
    """ops/moe.py grouped_down: off in the default build and in the grouped gate/up's alone; with
    grouped_down=1 on for every step (its lone row's bits are not moe_down's, so a one-row step
    must take it too), up to the top-k moe_group_pairs takes."""
    from strata_dist.kernels.abi import GROUP_MAX_K, KernelShape
    for off in (KernelShape(), KernelShape.parse("grouped_experts=1")):
        assert not moe.grouped_down(off, 8)
    on = KernelShape.parse("grouped_experts=1,grouped_down=1")
    assert moe.grouped_down(on, 8) and moe.grouped_down(on, GROUP_MAX_K)
    assert not moe.grouped_down(on, GROUP_MAX_K + 1)
