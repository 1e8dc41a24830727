import os
import sys

import pytest

# tests import their fixtures module (hf_fixtures) as a top-level module
sys.path.insert(0, os.path.dirname(__file__))



@pytest.fixture
def f16_kv_reference(monkeypatch):
    """The numpy reference with its K/V cache stored in f16, as GPU ranks store it: a comparison
    against it measures the GPU's arithmetic, not the storage precision (an f16 rounding of K can
    move a near-tie in routing, and a flipped expert moves that token's logits by far more than
    any rounding)."""
    from strata_dist.backends.numpy_backend import NumpyBackend
    monkeypatch.setattr(NumpyBackend, "kv_type", "f16")
