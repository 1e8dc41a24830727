"""Each architecture module provides models/interface.py's Architecture, with the same parameter
names in every function (the rest of the product calls them by position and by name)."""
import inspect
import re

import pytest

from strata_dist.models import ARCHITECTURES
from strata_dist.models.interface import Architecture

@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_architecture_modules_provide_the_interface(arch):
    module = ARCHITECTURES[arch]
    assert isinstance(module, Architecture)
    assert module.ARCH == arch and isinstance(module.ROUTER_PART, str)
    assert inspect.isclass(module.MODEL_CLASS)
    for name, member in vars(Architecture).items():
        if name.startswith("_") or not callable(member):
            continue
        want = list(inspect.signature(member).parameters)[1:]       # without self
        got = list(inspect.signature(getattr(module, name)).parameters)
        assert got == want, f"{arch}.{name}{tuple(got)}: the interface says {tuple(want)}"


def test_backends_implement_the_layer_ops_the_models_call():
    """backends/ops.py's LayerOps: the numpy reference implements every operation with the
    protocol's parameters, and the models' layer code reaches the backend through these (no
    `xp` in qwen3moe's forward)."""
    import inspect

    from strata_dist.backends.base import Backend
    from strata_dist.backends.numpy_backend import NumpyBackend
    from strata_dist.backends.ops import LayerOps
    from strata_dist.models import qwen3moe
    assert isinstance(NumpyBackend(), LayerOps)
    ops = [n for n, f in vars(LayerOps).items() if callable(f) and not n.startswith("_")]
    # the rank-ordered combine; the experts' outputs come from the store (models/common.py _combine_routed)
    assert {"rms_norm", "rope", "attend", "route", "combine_ranked", "linear", "rows"} <= set(ops)
    assert "moe" not in ops
    for name in ops:
        want = list(inspect.signature(getattr(LayerOps, name)).parameters)
        for cls in (Backend, NumpyBackend):
            assert list(inspect.signature(getattr(cls, name)).parameters) == want, (cls, name)
    forward = inspect.getsource(qwen3moe.EagerOps)       # what layer_step runs on a backend
    assert not re.search(r"\bxp\b", forward)
    assert "be.attend(" in forward and "be.rms_norm(" in forward


class _Recording:
    """Ops that record which op `layer_step` calls, in order."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def op(layer, *args):
            self.calls.append((name, layer))
            return ("a", "b", "c") if name in ("norm_qkv", "norm_mix_in") else name
        return op


def _protocol_ops(protocol) -> list[str]:
    return [n for n, f in vars(protocol).items() if callable(f) and not n.startswith("_")]


def _check_signatures(protocol, classes) -> None:
    for cls in classes:
        for name in _protocol_ops(protocol):
            want = list(inspect.signature(getattr(protocol, name)).parameters)
            assert list(inspect.signature(getattr(cls, name)).parameters) == want, (cls, name)


def test_the_layer_step_ops_have_one_signature():
    """models/qwen3moe.py writes the layer sequence once (`layer_step`) over the ops protocol
    Qwen3MoeOps; the eager ops (one session's window, a batched step's rows) and the decode
    graph's launches (backends/graph_ops.py) implement every op with the protocol's parameters,
    and `layer_step` calls nothing else."""
    from strata_dist.backends.graph_ops import GraphLayerOps
    from strata_dist.models import qwen3moe
    ops = _protocol_ops(qwen3moe.Qwen3MoeOps)
    assert ops == ["norm_qkv", "attention", "add_out_projection", "route", "add_experts"]
    _check_signatures(qwen3moe.Qwen3MoeOps, (qwen3moe.EagerOps, qwen3moe.RowsOps, GraphLayerOps))
    rec = _Recording()
    assert qwen3moe.layer_step(rec, None, 7, "h") == "add_experts"
    assert rec.calls == [(op, 7) for op in ops]


def test_the_qwen3next_layer_step_ops_have_one_signature():
    """The same for qwen3next (models/next_ops.py Qwen3NextOps; the graph's: backends/
    graph_ops.py NextGraphOps): a linear layer takes the mixer's ops, an attention layer the
    attention's, both the MoE's."""
    from strata_dist.backends.graph_ops import NextGraphOps
    from strata_dist.models import next_ops, qwen3next
    _check_signatures(next_ops.Qwen3NextOps,
                      (next_ops.NextEagerOps, next_ops.NextRowsOps, NextGraphOps))
    moe = [("route", 3), ("add_moe", 3)]
    for linear, mixer in ((True, ["norm_mix_in", "gated_delta", "add_mix_out"]),
                          (False, ["norm_qkv", "attention", "add_out_projection"])):
        g = type("G", (), {"is_linear": lambda self, layer: linear})()
        rec = _Recording()
        assert qwen3next.layer_step(rec, g, 3, "h") == "add_moe"
        assert rec.calls == [(op, 3) for op in mixer] + moe
        assert {op for op, _ in rec.calls} <= set(_protocol_ops(next_ops.Qwen3NextOps))
