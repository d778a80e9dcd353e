"""Each sampling stage does what its reference definition says, and a seed reproduces a run.

The references below are written the slow, obvious way (sorting, Python sets) so that
they share no code path with the vectorised implementation they check.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from triollm.errors import FieldError
from triollm.model.sampling import (
    SamplingParams,
    SequenceSampler,
    log_softmax,
    truncate,
)

V = 64


def logits(seed: int = 0, n: int = V, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=n) * scale).astype(np.float32)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max())
    return np.asarray(e / e.sum())


# -- parameters --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -0.1, r"temperature must be in \[0.0, 2.0\]"),
        ("temperature", 2.5, r"temperature must be in \[0.0, 2.0\]"),
        ("temperature", math.nan, "temperature must be a finite number"),
        ("top_p", 0.0, r"top_p must be in \(0.0, 1.0\]"),
        ("top_p", 1.5, r"top_p must be in \(0.0, 1.0\]"),
        ("min_p", -0.5, r"min_p must be in \[0.0, 1.0\]"),
        ("top_k", -1, "top_k must be an integer >= 0"),
        ("top_k", 2.5, "top_k must be an integer >= 0"),
        ("repetition_penalty", 0.0, r"repetition_penalty must be in \(0.0, 10.0\]"),
        ("presence_penalty", 2.5, r"presence_penalty must be in \[-2.0, 2.0\]"),
        ("frequency_penalty", -3, r"frequency_penalty must be in \[-2.0, 2.0\]"),
        ("seed", "7", "seed must be an integer"),
        ("logprobs", 21, r"logprobs must be an integer in \[0, 20\]"),
        ("logprobs", True, r"logprobs must be an integer in \[0, 20\]"),
    ],
)
def test_bad_parameters_name_the_field_and_the_range(
    field: str, value: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message) as exc:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert isinstance(exc.value, FieldError) and exc.value.field == field


def test_parameters_are_frozen() -> None:
    p = SamplingParams()
    with pytest.raises(AttributeError):
        p.temperature = 0.5  # type: ignore[misc]


# -- greedy and the draw -----------------------------------------------------------------


@given(seed=st.integers(0, 10_000))
@settings(max_examples=50, deadline=None)
def test_greedy_picks_the_argmax(seed: int) -> None:
    x = logits(seed)
    sampler = SequenceSampler(SamplingParams(temperature=0.0, top_k=3, top_p=0.1))
    assert sampler.sample(x).token_id == int(np.argmax(x))


def test_the_same_seed_gives_the_same_tokens() -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    rows = [logits(i) for i in range(40)]
    a = [SequenceSampler(params).sample(r).token_id for r in rows]
    runs = []
    for _ in range(2):
        s = SequenceSampler(params)
        runs.append([s.sample(r).token_id for r in rows])
    assert runs[0] == runs[1]
    other = SequenceSampler(SamplingParams(temperature=0.9, top_p=0.95, seed=99))
    assert [other.sample(r).token_id for r in rows] != runs[0]
    assert len(set(a)) > 1  # the rows really are sampled, not argmaxed


def test_a_sequences_draws_do_not_depend_on_other_samplers() -> None:
    # Two samplers interleaved (as in one batch) draw what each draws alone.
    params = SamplingParams(seed=5)
    rows = [logits(i) for i in range(30)]
    alone = SequenceSampler(params)
    expected = [alone.sample(r).token_id for r in rows]
    mine, neighbour = SequenceSampler(params), SequenceSampler(SamplingParams(seed=6))
    got = []
    for r in rows:
        neighbour.sample(r[::-1].copy())
        got.append(mine.sample(r).token_id)
    assert got == expected


def test_any_integer_seed_is_accepted() -> None:
    for seed in (-1, 0, 2**70):
        SequenceSampler(SamplingParams(seed=seed)).sample(logits())


def test_sampling_follows_the_softmax_distribution() -> None:
    # 4 tokens with known probabilities; a chi-square goodness-of-fit test over 20k seeded
    # draws. 16.27 is the 0.999 quantile for 3 degrees of freedom: a wrong CDF inversion
    # (an off-by-one in searchsorted shifts 10% of the mass) scores in the hundreds.
    x = np.log(np.array([0.1, 0.2, 0.3, 0.4], dtype=np.float32))
    s = SequenceSampler(SamplingParams(seed=0))
    n = 20_000
    counts = np.bincount([s._draw(x) for _ in range(n)], minlength=4)
    expected = n * np.array([0.1, 0.2, 0.3, 0.4])
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.27, counts


class FixedUniforms:
    """Stands in for a numpy Generator: hands out given uniform numbers in order."""

    def __init__(self, values: list[float]) -> None:
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0)


def test_the_blocked_draw_inverts_the_full_cumulative_distribution() -> None:
    # 5000 tokens span several search blocks; for each uniform number the two-level
    # search must land where a plain float64 running sum over everything lands.
    x = logits(8, n=5000, scale=2.0)
    x[1000:1100] = -np.inf  # a whole stretch of impossible tokens
    probs = np.exp(x.astype(np.float64) - x.max())
    cdf = np.cumsum(probs)
    us = [*np.random.default_rng(1).random(2000).tolist(), 0.0, 1.0 - 1e-16]
    s = SequenceSampler(SamplingParams())
    s._rng = FixedUniforms(us)  # type: ignore[assignment]
    got = [s._draw(x) for _ in us]
    expected = [int(np.searchsorted(cdf, u * cdf[-1], side="right")) for u in us]
    mismatches = [(g, e, u) for g, e, u in zip(got, expected, us, strict=True) if g != e]
    # Only a number within rounding of a boundary between two tokens may go either way.
    for g, e, u in mismatches:
        assert abs(g - e) == 1 and abs(u * cdf[-1] - cdf[min(g, e)]) < 1e-9 * cdf[-1]
    assert not any(1000 <= g < 1100 for g in got)


def test_temperature_sharpens_the_distribution() -> None:
    x = np.array([2.0, 1.0, 0.0], dtype=np.float32)
    cold = SequenceSampler(SamplingParams(temperature=0.25, seed=1))
    hot = SequenceSampler(SamplingParams(temperature=2.0, seed=1))
    n = 2000
    cold_top = sum(cold.sample(x).token_id == 0 for _ in range(n))
    hot_top = sum(hot.sample(x).token_id == 0 for _ in range(n))
    # softmax(x / 0.25)[0] ~ 0.98; softmax(x / 2)[0] ~ 0.51
    assert cold_top > 0.95 * n and hot_top < 0.6 * n


def test_a_token_with_zero_probability_is_never_drawn() -> None:
    x = np.full(V, -np.inf, dtype=np.float32)
    x[[3, 40]] = [0.0, 0.0]
    s = SequenceSampler(SamplingParams(seed=3))
    assert {s._draw(x) for _ in range(200)} == {3, 40}


# -- truncation against references --------------------------------------------------------


def ref_top_k(x: np.ndarray, k: int) -> set[int]:
    kth = sorted(x.tolist(), reverse=True)[k - 1]
    return {i for i, v in enumerate(x.tolist()) if v >= kth}


def ref_top_p(x: np.ndarray, p: float) -> set[int]:
    probs = softmax(x)
    keep: set[int] = set()
    total = 0.0
    for i in sorted(range(len(x)), key=lambda j: -probs[j]):
        keep.add(i)
        total += probs[i]
        if total >= p - 1e-12:
            break
    return keep


def ref_min_p(x: np.ndarray, m: float) -> set[int]:
    probs = softmax(x)
    return {i for i in range(len(x)) if probs[i] >= m * probs.max()}


def kept(x: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.isfinite(x)).tolist())


@given(seed=st.integers(0, 10_000), k=st.integers(1, V))
@settings(max_examples=100, deadline=None)
def test_top_k_keeps_the_k_largest(seed: int, k: int) -> None:
    x = logits(seed)
    assert kept(truncate(x, k, 1.0, 0.0)) == ref_top_k(x, k)


@given(seed=st.integers(0, 10_000), p=st.floats(0.01, 0.99))
@settings(max_examples=100, deadline=None)
def test_top_p_keeps_the_smallest_set_reaching_p(seed: int, p: float) -> None:
    x = logits(seed)
    got = kept(truncate(x, 0, p, 0.0))
    ref = ref_top_p(x, p)
    # A boundary within float rounding of p may go either way; otherwise the sets agree.
    if got != ref:
        probs = softmax(x)
        assert (
            abs(sum(probs[i] for i in ref) - p) < 1e-6 or abs(sum(probs[i] for i in got) - p) < 1e-6
        )
    assert int(np.argmax(x)) in got


@pytest.mark.parametrize(("scale", "p"), [(0.5, 0.9), (0.5, 0.3), (6.0, 0.95), (0.1, 0.999)])
def test_top_p_on_a_large_vocabulary_grows_its_search_until_the_nucleus_is_found(
    scale: float, p: float
) -> None:
    # Flat distributions need thousands of tokens to reach p: past the first partition.
    x = logits(21, n=5000, scale=scale)
    got = kept(truncate(x, 0, p, 0.0))
    ref = ref_top_p(x, p)
    assert got == ref
    assert len(ref) > 256 or scale == 6.0


@given(seed=st.integers(0, 10_000), m=st.floats(0.0, 1.0))
@settings(max_examples=100, deadline=None)
def test_min_p_drops_tokens_below_a_fraction_of_the_best(seed: int, m: float) -> None:
    x = logits(seed)
    got = kept(truncate(x, 0, 1.0, m))
    assert got == ref_min_p(x, m) or m > 0.999  # at m ~ 1 only rounding decides ties
    assert int(np.argmax(x)) in got


def test_filters_apply_in_order_top_k_then_top_p_then_min_p() -> None:
    x = logits(7)
    after_k = truncate(x, 10, 1.0, 0.0)
    after_p = truncate(after_k, 0, 0.8, 0.0)
    after_m = truncate(after_p, 0, 1.0, 0.2)
    assert kept(truncate(x, 10, 0.8, 0.2)) == kept(after_m)
    assert kept(after_m) <= kept(after_p) <= kept(after_k)


def test_sampled_tokens_stay_inside_the_truncated_set() -> None:
    x = logits(11)
    s = SequenceSampler(SamplingParams(top_k=5, seed=2))
    allowed = ref_top_k(x, 5)
    assert {s.sample(x).token_id for _ in range(300)} <= allowed


# -- penalties ---------------------------------------------------------------------------


def test_repetition_penalty_scales_seen_logits_toward_less_likely() -> None:
    x = np.array([2.0, -2.0, 2.0, -2.0, 1.0], dtype=np.float32)
    s = SequenceSampler(SamplingParams(repetition_penalty=2.0), prompt_ids=[0, 1])
    s.accept(4)
    got = s._penalised(x)
    np.testing.assert_array_equal(got, [1.0, -4.0, 2.0, -2.0, 0.5])  # 2 and 3 unseen


def test_presence_and_frequency_penalties_see_only_the_answer() -> None:
    x = np.zeros(6, dtype=np.float32)
    s = SequenceSampler(
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt_ids=[0, 1, 2]
    )
    for t in (3, 3, 3, 4):
        s.accept(t)
    got = s._penalised(x)
    np.testing.assert_allclose(got, [0, 0, 0, -(0.5 + 3 * 0.25), -(0.5 + 0.25), 0])


def test_sample_records_its_token_for_the_penalties() -> None:
    x = np.array([5.0, 4.9, 0.0], dtype=np.float32)
    s = SequenceSampler(SamplingParams(temperature=0.0, presence_penalty=1.0))
    assert [s.sample(x).token_id for _ in range(3)] == [0, 1, 0]


def test_greedy_sees_the_penalties() -> None:
    x = np.array([3.0, 2.0], dtype=np.float32)
    s = SequenceSampler(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt_ids=[0])
    assert s.sample(x).token_id == 1  # 3/2 < 2


def test_penalties_leave_the_callers_logits_alone() -> None:
    x = logits(1)
    before = x.copy()
    s = SequenceSampler(SamplingParams(repetition_penalty=1.5, seed=0), prompt_ids=range(10))
    s.sample(x)
    np.testing.assert_array_equal(x, before)


# -- log-probabilities -------------------------------------------------------------------


def test_logprobs_are_log_softmax_of_the_penalised_tempered_logits() -> None:
    x = logits(3)
    params = SamplingParams(temperature=0.7, top_k=2, repetition_penalty=1.3, logprobs=5, seed=0)
    s = SequenceSampler(params, prompt_ids=[int(np.argmax(x))])
    out = s.sample(x)
    ref = SequenceSampler(SamplingParams(repetition_penalty=1.3), prompt_ids=[int(np.argmax(x))])
    expected = log_softmax(ref._penalised(x) / np.float32(0.7))
    assert out.logprob == pytest.approx(expected[out.token_id], rel=1e-6)
    order = np.argsort(-expected)[:5]
    assert [t for t, _ in out.top_logprobs] == order.tolist()
    assert [lp for _, lp in out.top_logprobs] == pytest.approx(expected[order].tolist(), rel=1e-6)
    assert math.fsum(np.exp(expected)) == pytest.approx(1.0)


def test_logprobs_zero_gives_only_the_chosen_token() -> None:
    out = SequenceSampler(SamplingParams(temperature=0.0, logprobs=0)).sample(logits(4))
    assert out.logprob is not None and out.logprob <= 0.0 and out.top_logprobs == ()


def test_no_logprobs_unless_asked() -> None:
    out = SequenceSampler(SamplingParams(seed=1)).sample(logits(4))
    assert out.logprob is None and out.top_logprobs == ()


def test_greedy_logprobs_use_temperature_one() -> None:
    x = logits(5)
    out = SequenceSampler(SamplingParams(temperature=0.0, logprobs=1)).sample(x)
    assert out.logprob == pytest.approx(log_softmax(x)[int(np.argmax(x))], rel=1e-6)
    assert out.top_logprobs[0][0] == out.token_id


def test_log_softmax_is_stable_for_huge_logits() -> None:
    x = np.array([1e30, 0.0, -1e30], dtype=np.float32)
    out = log_softmax(x)
    assert out[0] == 0.0 and np.all(np.isfinite(out)) and out[1] == pytest.approx(-1e30)
