"""Sampling's arithmetic written once for numpy and CuPy (strata_dist/ops/sample.py), run
here with numpy: against the host sampler as it was before (written plainly below: the penalties
on the drawn ids, a stable sort, numpy's own seeded weighted choice), token for token and bit for
bit over every combination of the sampling parameters, the penalties and the bias; the grammar's
packed bitmask against unpacking its bytes; log-probabilities against a plain log-softmax; and a
graph step's row read where it is (StepLogits.on_device), never copied to the host.
tests/test_gpu_sample_ops.py runs the same functions with CuPy."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from stand_ins import run_check
from strata_dist.ops import sample as sample_ops
from strata_dist.backends.step_slots import StepLogits
from strata_dist.sampling.sampler import Sampler, SamplingParams, masked_row, prompt_logprobs, token_logprobs
from strata_dist.sampling.structured import GrammarError, GrammarMatcher
from strata_dist.gguf_file.tokenizer import GGUFTokenizer

VOCAB = 300
STEPS = 4
SAMPLING = list(itertools.product((0.0, 0.7, 1.5),          # temperature (0: greedy)
                                  (0, 1, 7, 60),             # top_k
                                  (1.0, 0.9, 0.3),           # top_p
                                  (0.0, 0.05, 0.4)))         # min_p
PENALTIES = list(itertools.product((0.0, 0.6, -1.2),        # presence
                                   (0.0, 0.35),              # frequency
                                   (1.0, 1.3, 0.8),          # repetition
                                   ((), ((3, 4.0), (250, -100.0), (VOCAB + 5, 9.0)),
                                    ((3, 1.0), (3, 2.5)))))  # logit bias (a token named twice)


# ---- the reference: the host sampler before the device path, written plainly --------------------

class ReferenceSampler:
    def __init__(self, params: SamplingParams, prompt_ids=()):
        self.p = params
        self.rng = np.random.default_rng(params.seed)
        self.counts: dict[int, int] = {}
        self.seen = set(prompt_ids) if params.repetition_penalty != 1.0 else set()

    def adjust(self, row) -> np.ndarray:
        p, out = self.p, np.array(row, dtype=np.float64)
        if p.repetition_penalty != 1.0 and self.seen:
            ids = np.array(sorted(t for t in self.seen if t < out.size), dtype=np.int64)
            v = out[ids]
            out[ids] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        for t, c in self.counts.items():
            if t < out.size:
                out[t] -= p.frequency_penalty * c + p.presence_penalty
        for t, b in p.logit_bias:
            if t < out.size:
                out[t] += b
        return out

    def kept(self, row):
        p = self.p
        order = np.argsort(-row, kind="stable")
        if p.top_k:
            order = order[:p.top_k]
        z = row[order] / p.temperature
        probs = np.exp(z - z.max())
        probs /= probs.sum()
        keep = len(order)
        if p.top_p < 1.0:
            keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1)
        if p.min_p > 0.0:
            keep = min(keep, max(1, int(np.count_nonzero(probs >= p.min_p * probs[0]))))
        return order[:keep], probs[:keep] / probs[:keep].sum()

    def __call__(self, row) -> int:
        row = self.adjust(row)
        if self.p.greedy:
            tok = int(np.argmax(row))
        else:
            order, probs = self.kept(row)
            tok = int(order[self.rng.choice(len(order), p=probs)])
        self.counts[tok] = self.counts.get(tok, 0) + 1
        if self.p.repetition_penalty != 1.0:
            self.seen.add(tok)
        return tok


def unpacked_mask(words: np.ndarray, n: int) -> np.ndarray:
    """The bitmask's bytes unpacked, little-endian bit order, as the host mask was made."""
    bits = np.unpackbits(words.astype("<u4").view(np.uint8), bitorder="little")[:n].view(bool)
    allowed = np.zeros(n, dtype=bool)
    allowed[:len(bits)] = bits
    return allowed


def rows(seed: int, n: int = STEPS, vocab: int = VOCAB) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = [(rng.normal(size=vocab) * 3).astype(np.float32) for _ in range(n)]
    if n > 1:
        out[1] = np.round(out[1], 0)  # many equal logits: ties go by token id (a stable sort)
    return out


# ---- tests ---------------------------------------------------------------------------------------

def test_every_parameter_combination_draws_the_reference_tokens():
    """The sampler (now sample_ops with numpy) and sample_ops called directly draw the same tokens,
    step after step with the counts growing, as the reference, for each of the 108 sampling
    combinations beside each of the 54 penalty and bias combinations."""
    prompt = [3, 11, 250, 17]
    for i, ((temp, top_k, top_p, min_p), (pres, freq, rep, bias)) in enumerate(
            itertools.product(SAMPLING, PENALTIES)):
        params = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=i,
                                presence_penalty=pres, frequency_penalty=freq,
                                repetition_penalty=rep, logit_bias=bias)
        ref, sampler = ReferenceSampler(params, prompt), Sampler(params, prompt)
        direct = np.random.default_rng(i)
        counts = sample_ops.TokenCounts(np, VOCAB, prompt if rep != 1.0 else (),
                                        track_seen=rep != 1.0)
        for row in rows(i % 17):
            adjusted = sample_ops.adjust(np, row.astype(np.float64), params, counts)
            assert np.array_equal(adjusted, ref.adjust(row)), params
            want = ref(row)
            assert sampler(row) == want, (params, sampler.drawn_counts)
            assert sample_ops.draw(np, adjusted, params, direct.random) == want, params
            counts.record(want)


def test_the_adjusted_row_and_the_distribution_are_the_references_bit_for_bit():
    for i, (pres, freq, rep, bias) in enumerate(PENALTIES):
        params = SamplingParams(temperature=0.8, top_p=0.95, min_p=0.02, presence_penalty=pres,
                                frequency_penalty=freq, repetition_penalty=rep, logit_bias=bias)
        ref, sampler = ReferenceSampler(params, [5, 6]), Sampler(params, [5, 6])
        for row in rows(100 + i):
            assert np.array_equal(sampler.adjust(row), ref.adjust(row))
            ids, probs = sampler.distribution(row)
            want_ids, want_probs = ref.kept(ref.adjust(row))
            assert np.array_equal(ids, want_ids) and np.array_equal(probs, want_probs)
            tok = ref(row)
            sampler.record(tok)


def test_a_row_with_no_number_to_draw_is_refused_not_drawn():
    params = SamplingParams(temperature=1.0, seed=1)
    with pytest.raises(ValueError, match="not numbers"):
        Sampler(params)(np.full(VOCAB, np.nan, dtype=np.float32))


@pytest.mark.parametrize("fault", ["one NaN", "all NaN", "no finite logit"])
def test_a_greedy_draw_from_a_row_with_no_number_is_refused_not_token_0(fault):
    """Greedy draws copy back the argmax's logit with the token: NaN anywhere in the row (numpy's
    argmax takes the first NaN) or a best logit of -inf ends the request, where it would have
    answered token 0 or the NaN's index."""
    row = np.random.default_rng(3).normal(size=VOCAB).astype(np.float32)
    if fault == "one NaN":
        row[VOCAB // 2] = np.nan
    else:
        row[:] = np.nan if fault == "all NaN" else -np.inf
    sampler = Sampler(SamplingParams(temperature=0.0))
    with pytest.raises(sample_ops.RowNotNumbers, match="not numbers"):
        sampler(row)
    row[:] = np.random.default_rng(4).normal(size=VOCAB)
    assert sampler(row) == int(np.argmax(row))


@pytest.mark.parametrize("n", [1, 31, 32, 33, 300, 520])
def test_the_bitmask_expands_to_the_unpacked_bytes(n):
    rng = np.random.default_rng(n)
    words = rng.integers(0, 2 ** 32, size=10, dtype=np.uint64).astype(np.uint32)
    words[rng.integers(0, 10, 3)] = 0
    allowed = sample_ops.allowed_tokens(np, words, n)
    assert allowed.dtype == bool and np.array_equal(allowed, unpacked_mask(words, n))
    assert sample_ops.any_allowed(words, n) == bool(allowed.any())
    row = rng.normal(size=n)
    assert np.array_equal(masked_row(row, words), np.where(unpacked_mask(words, n), row, -np.inf))


def test_only_bits_past_the_row_allowed_is_none_allowed():
    words = np.zeros(4, dtype=np.uint32)
    words[1] = 1 << 5                     # token 37 only
    assert not sample_ops.any_allowed(words, 37)
    assert sample_ops.any_allowed(words, 38)
    assert not sample_ops.any_allowed(words, 32)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from strata_dist.synth import write_synthetic
    path = tmp_path_factory.mktemp("sampleops") / "tiny.gguf"
    write_synthetic(path, like="tiny", quant="f32")
    return GGUFTokenizer.from_gguf(str(path))


SCHEMA = json.dumps({"type": "object", "properties": {"k": {"type": "integer"},
                                                      "c": {"enum": ["red", "blue"]}},
                     "required": ["k", "c"], "additionalProperties": False})


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_draws_what_the_unpacked_mask_draws(tokenizer, temperature):
    """Per step, the engine's packed words masked through sample_ops draw the token the reference
    draws from the row masked with the words' bytes unpacked (the mask as it was made on the
    host), with a penalty and a bias on top, until the grammar is finished."""
    params = SamplingParams(temperature=temperature, top_p=0.9, seed=4, presence_penalty=0.5,
                            logit_bias=((7, 3.0),))
    m = GrammarMatcher("json_schema", SCHEMA, lambda: tokenizer)
    ref, sampler = ReferenceSampler(params), Sampler(params)
    rng = np.random.default_rng(9)
    n = tokenizer.vocab_size + 8          # a row longer than the vocabulary: the rest never
    for step in range(64):
        row = (rng.normal(size=n) * 4).astype(np.float32)
        words = m.bitmask_words(n)
        assert np.array_equal(m.allowed(n), unpacked_mask(words, n))
        assert not unpacked_mask(words, n)[tokenizer.vocab_size:].any()
        want = ref(np.where(unpacked_mask(words, n), row.astype(np.float64), -np.inf))
        assert sampler(masked_row(row, words)) == want
        if m.advance(want):
            break
    else:
        pytest.fail("the grammar never finished")
    assert step > 3


def test_a_grammar_that_allows_nothing_in_the_row_says_so(tokenizer):
    m = GrammarMatcher("lark", 'start: "}"', lambda: tokenizer)
    allowed = np.flatnonzero(m.allowed(tokenizer.vocab_size))
    assert allowed.size
    with pytest.raises(GrammarError, match="allows no token"):
        m.bitmask_words(int(allowed.min()))


def reference_log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("top", [0, 1, 5, 20])
def test_logprobs_are_the_plain_log_softmax_and_its_top(top):
    for row in rows(7, n=3)[::2]:   # rows with no tie at the top: which of tied values makes
        lp = reference_log_softmax(row)   # the cut is the partition's choice, as it always was
        got = token_logprobs(row, 17, top)
        assert got.logprob == lp[17]
        # most likely first, ties by token id
        want = sorted(range(VOCAB), key=lambda t: (-lp[t], t))[:top]
        assert got.top_ids == want and got.top_logprobs == [lp[t] for t in want]
    block = np.stack(rows(8, n=3)[::2])
    lp = reference_log_softmax(block)
    for r, g in enumerate(prompt_logprobs(block, [1, 2], top)):
        assert g.logprob == lp[r, r + 1]
        assert g.top_ids == sorted(range(VOCAB), key=lambda t: (-lp[r, t], t))[:top]


def test_a_graph_steps_row_is_read_where_it_is_never_copied_to_the_host():
    """A StepLogits whose row the sampler, the mask and the logprobs read through `on_device`:
    copying it to the host (`np.asarray`, which imports the GPU module) fails on this machine, so
    the answers below, equal to the host row's, were computed where the row is."""
    row = rows(3, n=1)[0]
    params = SamplingParams(temperature=0.9, top_k=40, seed=2, repetition_penalty=1.2,
                            frequency_penalty=0.3, logit_bias=((1, 2.0),))
    step = StepLogits(int(np.argmax(row)), row)
    with pytest.raises(ImportError):
        np.asarray(step)
    host, device = Sampler(params, [4]), Sampler(params, [4])
    assert [device(step) for _ in range(5)] == [host(row) for _ in range(5)]
    words = np.full(VOCAB // 32 + 1, 0x0F0F0F0F, dtype=np.uint32)
    assert np.array_equal(masked_row(step, words), masked_row(row, words))
    assert token_logprobs(step, 5, 3) == token_logprobs(row, 5, 3)
    stale = StepLogits(0, row, current=lambda: False)
    with pytest.raises(RuntimeError, match="overwritten"):
        Sampler(params)(stale)


def test_a_gpu_runner_launches_no_step_ahead_of_a_row_its_sampler_reads():
    """SingleProcessRunner on a GPU (the decode graph on the CuPy stand-ins, kernels not run,
    tests/sampling_ahead_check.py): a greedy generation with a penalty or a bias reads each row,
    so no step may be launched ahead of it (that step overwrites the row: StepLogits raises);
    a plain greedy one still takes its steps ahead."""
    report = run_check("sampling_ahead_check.py", timeout=300)
    assert report["graph"] == "DecodeGraph"
    assert report["plain"] == {"tokens": 6, "ahead_taken": 4}
    assert report["repetition"] == report["bias"] == {"tokens": 6, "ahead_taken": 0}, report
