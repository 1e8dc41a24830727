"""Sampling's arithmetic on the card: strata_dist/ops/sample.py with CuPy against the same
functions with numpy (which tests/test_sample_ops.py holds, bit for bit, to the host sampler as it
was), on rows of a Qwen3-sized vocabulary; and the sampler drawing from a graph step's row
(StepLogits over a device array) as it draws from the host copy. Run on the GPU machine:
pytest -m gpu."""
import numpy as np
import pytest

from strata_dist.ops import sample as sample_ops
from strata_dist.backends.step_slots import StepLogits
from strata_dist.sampling.sampler import Sampler, SamplingParams, masked_row, token_logprobs

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

VOCAB = 151_936
PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=2),
    SamplingParams(temperature=1.2, min_p=0.05, seed=3, repetition_penalty=1.3),
    SamplingParams(temperature=1.0, top_p=0.5, seed=4, presence_penalty=0.6,
                   frequency_penalty=0.4, logit_bias=((7, 5.0), (151_000, -100.0))),
    SamplingParams(repetition_penalty=0.8, frequency_penalty=1.0, logit_bias=((3, 1.0), (3, 2.0))),
]


def random_rows(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=VOCAB) * 4).astype(np.float32) for _ in range(n)]


def counts_pair(params, prompt, drawn):
    track = params.repetition_penalty != 1.0
    return (sample_ops.TokenCounts(np, VOCAB, prompt, drawn, track_seen=track),
            sample_ops.TokenCounts(cp, VOCAB, prompt, drawn, track_seen=track))


@pytest.mark.parametrize("params", PARAMS)
def test_the_adjusted_row_is_numpys_bit_for_bit(params):
    row = random_rows(1, 1)[0]
    host, dev = counts_pair(params, [5, 9, 151_935], {9: 2, 40: 1})
    for tok in (9, 77, 151_935):
        host.record(tok)
        dev.record(tok)
    assert np.array_equal(cp.asnumpy(dev.drawn_ids), host.drawn_ids)
    assert np.array_equal(cp.asnumpy(dev.drawn_counts), host.drawn_counts)
    assert np.array_equal(cp.asnumpy(dev.seen_ids), host.seen_ids)
    want = sample_ops.adjust(np, row.astype(np.float64), params, host)
    got = sample_ops.adjust(cp, cp.asarray(row, dtype=cp.float64), params, dev)
    assert np.array_equal(cp.asnumpy(got), want)


def test_the_bitmask_expands_on_the_card_as_on_the_host():
    rng = np.random.default_rng(2)
    words = rng.integers(0, 2 ** 32, size=-(-VOCAB // 32), dtype=np.uint64).astype(np.uint32)
    words[:100] = 0
    for n in (VOCAB, VOCAB + 64, 1000, 33):
        got = sample_ops.allowed_tokens(cp, words, n)
        assert np.array_equal(cp.asnumpy(got), sample_ops.allowed_tokens(np, words, n))
    row = random_rows(3, 1)[0]
    got = masked_row(cp.asarray(row), words)
    assert isinstance(got, cp.ndarray)
    assert np.array_equal(cp.asnumpy(got), masked_row(row, words))


@pytest.mark.parametrize("params", [p for p in PARAMS if not p.greedy])
def test_what_a_draw_picks_from_and_what_it_picks_are_numpys(params):
    row = random_rows(4, 1)[0].astype(np.float64)
    ids, probs = sample_ops.kept(np, row, params)
    dev_ids, dev_probs = sample_ops.kept(cp, cp.asarray(row), params)
    assert np.array_equal(cp.asnumpy(dev_ids), ids)
    np.testing.assert_allclose(cp.asnumpy(dev_probs), probs, rtol=1e-12, atol=1e-300)
    cdf = np.cumsum(probs) / probs.sum()
    for u in np.random.default_rng(5).random(50):
        if np.abs(cdf - u).min() < 1e-9:    # a cumulative sum's last bits may differ on the card
            continue
        assert (sample_ops.pick(cp, dev_ids, dev_probs, float(u))
                == sample_ops.pick(np, ids, probs, float(u)))


@pytest.mark.parametrize("params", PARAMS)
def test_the_sampler_draws_a_device_step_as_it_draws_its_host_copy(params):
    """A graph step's row (StepLogits over a device array) sampled on the card, with the penalty
    counts kept there and a grammar's bitmask expanded there: the same tokens as the host copy."""
    rng = np.random.default_rng(6)
    words = rng.integers(0, 2 ** 32, size=-(-VOCAB // 32), dtype=np.uint64).astype(np.uint32)
    on_card, on_host = Sampler(params, [1, 2, 3]), Sampler(params, [1, 2, 3])
    for i, row in enumerate(random_rows(7, 6)):
        dev = cp.asarray(row)
        step = StepLogits(int(cp.argmax(dev)), dev)
        if i % 2:
            got = on_card(masked_row(step, words))
            want = on_host(masked_row(row, words))
        else:
            got, want = on_card(step), on_host(row)
        assert got == want, (params, i)
        lp, lp_host = token_logprobs(step, got, 5), token_logprobs(row, got, 5)
        assert lp.top_ids == lp_host.top_ids
        np.testing.assert_allclose([lp.logprob] + lp.top_logprobs,
                                   [lp_host.logprob] + lp_host.top_logprobs, rtol=0, atol=1e-9)
    if params.reshapes_logits:     # the penalty counts live on the card
        assert on_card._counts.xp is cp and on_card._counts.n == VOCAB


@pytest.mark.parametrize("params", PARAMS)
def test_a_batched_steps_rows_draw_on_the_card_what_the_host_draws(params):
    """The rows of a batched graph step stay on the card (BatchLogits: backends/batched_decode.py
    step_rows): each row's sampler draws from its RowLogits what it draws from the host copy of
    the row, greedy from the token reduced on the card."""
    from strata_dist.backends.step_slots import BatchLogits
    host_rows = np.stack(random_rows(11, 4))
    rows = cp.asarray(host_rows)
    best = host_rows.argmax(axis=1)
    batch = BatchLogits(rows, best, np.ones(4, dtype=bool), np.zeros(4, dtype=bool))
    for i in range(4):
        device, host = Sampler(params, [4, 5]), Sampler(params, [4, 5])
        assert [device(batch[i]) for _ in range(3)] == [host(host_rows[i]) for _ in range(3)]


WARM_CHECK = r"""
import os, sys
import numpy as np
import cupy as cp
from strata_dist.sampling.sampler import (Sampler, SamplingParams, masked_row, token_logprobs,
                                          warm_up)
def compiled():
    return sum(len(f) for _, _, f in os.walk(os.environ["CUPY_CACHE_DIR"]))
row = cp.asarray((np.random.default_rng(0).standard_normal(151_936) * 4).astype(np.float32))
warm_up(cp.zeros(row.size, cp.float32))
after_warm = compiled()
for params in [SamplingParams(), SamplingParams(temperature=0.8, seed=1),
               SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=2),
               SamplingParams(temperature=1.2, min_p=0.05, seed=3, repetition_penalty=1.3),
               SamplingParams(temperature=1.0, top_p=0.5, seed=4, presence_penalty=0.6,
                              frequency_penalty=0.4, logit_bias=((7, 5.0), (151_000, -100.0))),
               SamplingParams(repetition_penalty=0.8, logit_bias=((3, 1.0), (3, 2.0)))]:
    s = Sampler(params, prompt_ids=[5, 9, 5])
    for _ in range(3):
        s(row)
    if not params.greedy:
        s.distribution(row)
words = np.zeros(-(-row.size // 32), np.uint32); words[10] = 0b1011
Sampler()(masked_row(row, words))
Sampler(SamplingParams(temperature=0.9, seed=5))(masked_row(row, words))
token_logprobs(row, 17, 20)
print(after_warm, compiled())
"""


def test_after_the_warm_up_a_request_s_sampling_compiles_nothing(tmp_path):
    """sampler.warm_up (a GPU last stage runs it at load) leaves no kernel of the sampling ops
    for a request to compile: in a process of its own with an empty CuPy kernel cache, the
    draws of every kind of request after it (greedy, sampled, top-k/p, min-p, penalties, bias,
    a grammar's mask, logprobs) add no binary to the cache."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, CUPY_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", WARM_CHECK], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    after_warm, after_requests = map(int, done.stdout.split()[-2:])
    assert after_warm > 0                       # the warm-up compiled into this empty cache
    assert after_requests == after_warm, (after_warm, after_requests)
