"""Pricing, shape, inventory and params: the arithmetic everything else stands on."""
import numpy as np
import pytest

from test_plan_fixtures import MIB, hybrid_kinds, make_shape
from strata_dist.plan import (HANDOFF_ROWS, HEAD_RESERVE_BYTES, STAGE_WORK_RESERVE_BYTES, Device, ModelShape,
                              PlanParams, devices_from_json, params_from_env, qwen3_30b_a3b_shape,
                              reserve_bytes, session_bytes, session_parts, weights_bytes)
from strata_dist.plan.device import order_devices
from strata_dist.plan.pricing import DECODE_ROWS, range_fixed_table, stage_fixed_bytes


def test_weights_are_priced_from_lb_not_from_layer_0():
    shape = make_shape(n_layers=10)
    own = sum(shape.layer_dense_bytes[4:7])
    assert weights_bytes(shape, 4, 7, first=False, last=False) == own
    # the silent failure of seed #390: [0, le) instead of [lb, le)
    assert weights_bytes(shape, 4, 7, first=False, last=False) != sum(shape.layer_dense_bytes[0:7])
    # every range, against a per-layer sum starting at lb
    for lb in range(10):
        for le in range(lb + 1, 11):
            assert weights_bytes(shape, lb, le, False, False) == sum(shape.layer_dense_bytes[l] for l in range(lb, le))


def test_session_is_priced_from_lb_not_from_layer_0():
    shape = make_shape(n_layers=10)
    cells = 1000
    kv = sum(shape.kv_bytes_per_cell[5:9]) * cells
    assert session_parts(shape, cells, 5, 9)["kv"] == kv
    assert session_bytes(shape, cells, 5, 9) < session_bytes(shape, cells, 0, 9)


def test_embedding_on_first_head_on_last():
    shape = make_shape(n_layers=6)
    base = weights_bytes(shape, 2, 4, False, False)
    assert weights_bytes(shape, 2, 4, True, False) == base + shape.embed_bytes
    assert weights_bytes(shape, 2, 4, False, True) == base + shape.head_bytes


def test_weight_slice_kill_switch_loads_every_dense_tensor():
    shape = make_shape(n_layers=6)
    whole = sum(shape.layer_dense_bytes) + shape.embed_bytes + shape.head_bytes
    assert weights_bytes(shape, 2, 4, False, False, weight_slice=False) == whole


def test_a_stage_prices_only_its_own_routers():
    """(Replicated routers were priced but never loaded; they are gone from both.)"""
    shape = make_shape(n_layers=6)
    assert weights_bytes(shape, 2, 4, False, False) == sum(shape.layer_dense_bytes[2:4])
    assert "replicate_routers" not in PlanParams().to_dict()


def test_range_without_attention_still_carves_one_primary_state():
    shape = make_shape(n_layers=8, kinds=hybrid_kinds(8))   # attention at 3 and 7
    cells = 4096
    parts = session_parts(shape, cells, 0, 3)                # linear layers only
    assert parts["kv"] == 0 and parts["scratch"] == 0
    assert parts["primary"] == shape.rope_bytes_per_cell * cells > 0
    assert parts["recurrent"] == sum(shape.recurrent_bytes[0:3])
    # one primary per stage, not one per attention layer
    assert session_parts(shape, cells, 0, 8)["primary"] == parts["primary"]
    with_attn = session_parts(shape, cells, 2, 5)
    assert with_attn["kv"] == shape.kv_bytes_per_cell[3] * cells
    assert with_attn["scratch"] == DECODE_ROWS * shape.n_head * cells * 4


def test_reserves_named_once():
    shape = make_shape()
    hand = HANDOFF_ROWS * shape.hidden * 4
    assert reserve_bytes(shape, True, True) == STAGE_WORK_RESERVE_BYTES + HEAD_RESERVE_BYTES
    assert reserve_bytes(shape, True, False) == STAGE_WORK_RESERVE_BYTES + hand
    assert reserve_bytes(shape, False, False) == STAGE_WORK_RESERVE_BYTES + 2 * hand
    assert reserve_bytes(shape, False, True) == STAGE_WORK_RESERVE_BYTES + HEAD_RESERVE_BYTES + hand


@pytest.mark.parametrize("params", [PlanParams(), PlanParams(weight_slice=False),
                                    PlanParams(kv_resident=100)])
def test_vectorised_range_table_equals_scalar_pricing(params):
    shape = make_shape(n_layers=12, kinds=hybrid_kinds(12))
    table = range_fixed_table(shape, 777, weight_slice=params.weight_slice,
                              resident=params.kv_resident)
    for lb in range(12):
        for le in range(lb + 1, 13):
            assert table[lb, le] == sum(stage_fixed_bytes(shape, 777, lb, le,
                                                          weight_slice=params.weight_slice,
                                                          resident=params.kv_resident))


def test_bad_ranges_refused():
    shape = make_shape(n_layers=4)
    for lb, le in [(2, 2), (3, 1), (-1, 2), (0, 5)]:
        with pytest.raises(ValueError):
            weights_bytes(shape, lb, le, False, False)


def test_qwen3_30b_geometry():
    shape = qwen3_30b_a3b_shape()
    assert shape.n_layers == 48 and shape.n_experts == 128 and shape.top_k == 8
    assert shape.blob_bytes[0] == 3 * 2048 * 768 * 34 // 32 == 5_013_504
    assert shape.kv_bytes_per_cell[0] == 2 * 4 * 128 * 2


def test_shape_validation():
    shape = make_shape(n_layers=4)
    d = shape.to_dict()
    assert ModelShape.from_dict(d) == shape
    with pytest.raises(ValueError, match="blob_bytes has 3 entries"):
        ModelShape.from_dict({**d, "blob_bytes": d["blob_bytes"][:3]})
    with pytest.raises(ValueError, match="layer_kind"):
        ModelShape.from_dict({**d, "layer_kind": ["attention", "mamba", "attention", "attention"]})
    with pytest.raises(ValueError, match="router_bytes"):
        ModelShape.from_dict({**d, "router_bytes": [x + 1 for x in d["layer_dense_bytes"]]})


# --- inventory ------------------------------------------------------------------------------------
def test_devices_from_json():
    devs = devices_from_json([
        {"name": "RTX 3060", "total_mib": 12288, "free_mib": 11000.5, "mem_bandwidth_gbs": 360},
        {"name": "H200", "total_mib": 143771, "free_mib": 140000, "host": "box2", "index": 3},
        {"name": "cpu", "total_mib": 65536, "free_mib": 60000, "kind": "cpu"},
    ])
    assert devs[0] == Device("RTX 3060", 12288 * MIB, int(11000.5 * MIB), 360.0, "localhost", 0)
    assert devs[1].host == "box2" and devs[1].index == 3 and devs[1].mem_bandwidth_gbs is None
    assert devs[0].kind == "cuda" and devs[0].decodes_as_graph
    assert devs[2].kind == "cpu" and not devs[2].decodes_as_graph


@pytest.mark.parametrize("obj, match", [
    ({}, "non-empty JSON list"),
    ([], "non-empty JSON list"),
    ([3], "entry 0: expected an object"),
    ([{"name": "a", "total_mib": 10}], r"entry 0 \('a'\): missing field 'free_mib'"),
    ([{"name": "a", "total_mib": 10, "free_mb": 5}], "missing field 'free_mib'"),
    ([{"name": "a", "total_mib": 10, "free_mib": 5, "bw": 1}], "unknown field 'bw'"),
    ([{"name": "a", "total_mib": 10, "free_mib": 11}], "free_mib 11 exceeds total_mib 10"),
    ([{"name": "a", "total_mib": "10", "free_mib": 5}], "total_mib must be a number"),
    ([{"name": "a", "total_mib": 10, "free_mib": -1}], "free_mib must be >= 0"),
    ([{"name": "a", "total_mib": 10, "free_mib": 5, "mem_bandwidth_gbs": 0}], "mem_bandwidth_gbs must be > 0"),
    ([{"name": "", "total_mib": 10, "free_mib": 5}], "name must be a non-empty string"),
    ([{"name": "a", "total_mib": 10, "free_mib": 5, "kind": "gpu"}], "kind must be one of cuda, cpu, got 'gpu'"),
    ([{"name": "a", "total_mib": 10, "free_mib": 5},
      {"name": "b", "total_mib": 10, "free_mib": 5, "index": 0}], r"entry 1 \('b'\): device localhost:0 is listed twice"),
])
def test_devices_from_json_names_the_bad_entry(obj, match):
    with pytest.raises(ValueError, match=match):
        devices_from_json(obj)


def test_device_order_fastest_last_is_stable():
    devs = [Device("a", 1, 1, 400.0, index=0), Device("b", 1, 1, 300.0, index=1),
            Device("c", 1, 1, None, index=2), Device("d", 1, 1, 300.0, index=3)]
    assert [d.name for d in order_devices(devs, "fastest_last", 350.0)] == ["b", "d", "c", "a"]
    assert [d.name for d in order_devices(devs, "as_given", 350.0)] == ["a", "b", "c", "d"]
    with pytest.raises(ValueError):
        order_devices(devs, "random", 1.0)


# --- params ---------------------------------------------------------------------------------------
def test_params_from_env():
    p = params_from_env({"STRATA_SPLIT_COVER_B": "2.5", "STRATA_SPLIT_MISS_MS": "0.3",
                         "STRATA_SPLIT_LAYER_MS": "0.02",
                         "STRATA_SPLIT_HANDOFF_MS": "0.1", "STRATA_PREFILL_LEND_PCT": "50",
                         "STRATA_REMOTE_AUTO": "0", "STRATA_WEIGHT_SLICE": "0",
                         "STRATA_STAGE_CACHE_SLOTS": "100", "UNRELATED": "x", "STRATA_SPLIT_LINK_MS": ""})
    assert p == PlanParams(cover_b=2.5, miss_ms=0.3, layer_ms=0.02, handoff_ms=0.1, lend_pct=50,
                           remote_auto=False, weight_slice=False, stage_cache_slots=100)
    assert params_from_env({}) == PlanParams()


@pytest.mark.parametrize("env, match", [
    ({"STRATA_SPLIT_COVER_B": "three"}, "STRATA_SPLIT_COVER_B='three'"),
    ({"STRATA_SPLIT_COVER_B": "-1"}, "STRATA_SPLIT_COVER_B='-1'"),
    ({"STRATA_PREFILL_LEND_PCT": "150"}, "STRATA_PREFILL_LEND_PCT='150'"),
    ({"STRATA_REMOTE_AUTO": "yes"}, "STRATA_REMOTE_AUTO='yes'"),
    ({"STRATA_SPLIT_LAYER_MS": "-0.1"}, "STRATA_SPLIT_LAYER_MS='-0.1'"),
])
def test_params_from_env_names_the_bad_variable(env, match):
    with pytest.raises(ValueError, match=match):
        params_from_env(env)


def test_rows_of_range_table_are_int64():
    assert range_fixed_table(make_shape(), 10).dtype == np.int64
