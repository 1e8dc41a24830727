import os
import signal
import sys

import pytest

# tests import their fixtures module (hf_fixtures) as a top-level module
sys.path.insert(0, os.path.dirname(__file__))

# A suite started as a shell's background job (`cmd &`, no job control) begins with SIGINT
# ignored, and so would every launcher it starts: an ignored SIGINT stays ignored there, as the
# one who started it asked (launcher/stop_signals.py). The tests that Ctrl-C a launcher need it
# delivered, so the suite's own children start with it at its default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# float32_prompt_kernels' variables (also tests/test_gpu_kv_q8_mirror.py's REFERENCE_OPTIONS, which
# tests/kv_q8_general_check.py runs the general path under on the host)
FLOAT32_PROMPT_KERNELS = {"STRATA_ROWS_MMA": "0", "STRATA_FLASH_PREFILL": "0",
                          "STRATA_F16_PROMPT_GEMM": "0"}


@pytest.fixture
def float32_prompt_kernels(monkeypatch):
    """A GPU prompt's experts, attention and quantized dense matrices in float32 (the row
    kernels' FMA build, attention and GEMMs off the tensor cores): the GPU default rounds a
    prompt's rows to f16 on the tensor cores (and the general path's decode steps', which take
    the same products), which alone moves tiny random models' logits by ~4e-2 (1e-2 on
    qwen3next's). Those kernels are
    checked against numpy at their own tolerance (test_gpu_kernels.py); a test of the model code
    against numpy at float32 precision takes this."""
    for name, value in FLOAT32_PROMPT_KERNELS.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def f16_kv_reference(monkeypatch):
    """The numpy reference with its K/V cache stored in f16, as GPU ranks store it: a comparison
    against it measures the GPU's arithmetic, not the storage precision (an f16 rounding of K can
    move a near-tie in routing, and a flipped expert moves that token's logits by far more than
    any rounding)."""
    from strata_dist.backends.numpy_backend import NumpyBackend
    monkeypatch.setattr(NumpyBackend, "kv_type", "f16")
