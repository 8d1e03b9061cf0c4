import sys
from collections import deque
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.run.sampling import Sampler, SamplingParams  # noqa: E402

VOCAB = 49152


def random_logits(seed: int, n: int = VOCAB, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


def draws(params: SamplingParams, logits: np.ndarray, n: int, recent=()) -> list[int]:
    s = Sampler(params)
    return [s.sample(logits, recent) for _ in range(n)]


def softmax(x: np.ndarray, t: float = 1.0) -> np.ndarray:
    e = np.exp((x - x.max()) / t)
    return e / e.sum()


@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.1}, {"temperature": float("nan")}, {"temperature": float("inf")},
    {"top_k": -1}, {"top_k": 2.5}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_p": -0.2},
    {"repeat_penalty": 0.0}, {"repeat_penalty": -1.0}, {"repeat_last_n": -1}, {"seed": -3}, {"seed": 1.5},
    {"min_p": -0.1}, {"min_p": 1.0}, {"min_p": float("nan")}, {"presence_penalty": 2.5},
    {"frequency_penalty": float("nan")}, {"frequency_penalty": -3.0},
])
def test_invalid_params_rejected(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_params_mutated_after_creation_are_checked():
    p = SamplingParams()
    p.top_p = 2.0
    with pytest.raises(ValueError, match="top_p"):
        Sampler(p)


def test_greedy_is_argmax():
    s = Sampler(SamplingParams())
    for seed in range(10):
        logits = random_logits(seed)
        assert s.sample(logits) == int(np.argmax(logits))


def test_same_seed_same_sequence_different_seed_differs():
    logits = random_logits(0, scale=1.0)  # flat enough that draws vary a lot
    params = dict(temperature=1.0, top_k=50, top_p=0.95)
    a = draws(SamplingParams(seed=7, **params), logits, 200)
    b = draws(SamplingParams(seed=7, **params), logits, 200)
    c = draws(SamplingParams(seed=8, **params), logits, 200)
    assert a == b
    assert len(set(a)) > 10  # really sampling, not collapsing onto one token
    assert sum(x != y for x, y in zip(a, c)) > 150


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0, 100.0])
def test_top_k_one_is_greedy(temperature):
    for seed in range(5):
        logits = random_logits(seed)
        got = draws(SamplingParams(temperature=temperature, top_k=1, seed=seed), logits, 20)
        assert got == [int(np.argmax(logits))] * 20


@pytest.mark.parametrize("temperature", [0.7, 1.0, 3.0])
def test_tiny_top_p_is_greedy(temperature):
    for seed in range(5):
        logits = random_logits(seed)
        got = draws(SamplingParams(temperature=temperature, top_p=1e-6, seed=seed), logits, 20)
        assert got == [int(np.argmax(logits))] * 20


def test_top_k_limits_support():
    logits = random_logits(3, scale=0.5)
    allowed = set(np.argsort(-logits)[:5].tolist())
    got = draws(SamplingParams(temperature=2.0, top_k=5, seed=1), logits, 500)
    assert set(got) == allowed


@pytest.mark.parametrize("k", [1, 7, 40, 200])
@pytest.mark.parametrize("case", ["plain", "masked", "ties", "short"])
def test_top_k_candidates_are_the_k_largest(k, case):
    """The sampler's top-k (a floor from the blocks' maxima, then a partition of what clears it) takes the same
    values as a partition of every logit: with masked (-inf) logits, with ties at the k-th, with a vocab too short
    for the floor."""
    from engine.run.sampling import largest

    logits = random_logits(k, n=300 if case == "short" else VOCAB + 17)
    if case == "masked":
        logits[np.random.default_rng(k).integers(0, logits.size, logits.size // 2)] = -np.inf
    if case == "ties":
        logits = np.round(logits)
    got = largest(logits, k)
    assert got.size == k == np.unique(got).size
    assert np.array_equal(np.sort(logits[got]), np.sort(logits[np.argpartition(logits, -k)[-k:]]))


def test_top_p_keeps_smallest_nucleus():
    probs = np.array([0.05, 0.4, 0.3, 0.15, 0.1])
    logits = np.log(probs).astype(np.float32)
    # 0.4 + 0.3 = 0.7 < 0.75, so the third most likely (0.15) is needed too
    got = draws(SamplingParams(temperature=1.0, top_p=0.75, seed=2), logits, 600)
    assert set(got) == {1, 2, 3}


def test_top_p_on_flat_large_vocab_looks_past_first_candidates():
    logits = np.zeros(VOCAB, dtype=np.float32)
    logits[:10] = 0.5
    got = draws(SamplingParams(temperature=1.0, top_p=0.5, seed=4), logits, 100)
    assert len(set(got)) > 90 and all(0 <= g < VOCAB for g in got)


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.99])
def test_top_p_support_matches_full_sort(top_p):
    from engine.run.sampling import _nucleus

    for seed in range(3):
        probs = softmax(random_logits(seed).astype(np.float64), 0.8)
        order = np.argsort(-probs, kind="stable")
        n = int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1
        assert set(_nucleus(probs, top_p).tolist()) == set(order[:n].tolist())


def test_repeat_penalty_changes_choice():
    logits = np.zeros(100, dtype=np.float32)
    logits[3], logits[5] = 2.0, 1.8
    greedy = Sampler(SamplingParams())
    penalised = Sampler(SamplingParams(repeat_penalty=1.3))
    assert greedy.sample(logits, recent=[3]) == 3
    assert penalised.sample(logits, recent=[3]) == 5  # 2.0 / 1.3 < 1.8
    assert penalised.sample(logits, recent=[7, 9]) == 3  # unrelated history changes nothing

    negative = np.full(100, -5.0, dtype=np.float32)
    negative[3], negative[5] = -1.0, -1.2
    assert penalised.sample(negative, recent=[3]) == 5  # -1.0 * 1.3 < -1.2
    assert logits[3] == 2.0 and negative[3] == -1.0  # caller's arrays untouched


def test_repeat_penalty_window():
    logits = np.zeros(100, dtype=np.float32)
    logits[3], logits[5] = 2.0, 1.8
    recent = [3] + [7] * 10
    assert Sampler(SamplingParams(repeat_penalty=1.3, repeat_last_n=10)).sample(logits, recent) == 3
    assert Sampler(SamplingParams(repeat_penalty=1.3, repeat_last_n=11)).sample(logits, recent) == 5
    assert Sampler(SamplingParams(repeat_penalty=1.3, repeat_last_n=0)).sample(logits, recent) == 3
    assert Sampler(SamplingParams(repeat_penalty=1.3, repeat_last_n=11)).sample(logits, deque(recent)) == 5
    assert Sampler(SamplingParams(repeat_penalty=1.3)).sample(logits, np.array(recent)) == 5


def test_min_p_keeps_tokens_near_the_best():
    # Probabilities at temperature 1: 0.5, 0.25, 0.125, 0.0625, 0.0625. min-p 0.2 keeps p >= 0.1: the first three.
    probs = np.array([0.5, 0.25, 0.125, 0.0625, 0.0625])
    logits = np.log(probs).astype(np.float32)
    n = 12000
    counts = np.bincount(draws(SamplingParams(temperature=1.0, min_p=0.2, seed=3), logits, n), minlength=5)
    assert counts[3] == counts[4] == 0
    expected = np.array([0.5, 0.25, 0.125]) / 0.875  # what is kept is renormalised
    chi2 = ((counts[:3] - n * expected) ** 2 / (n * expected)).sum()
    assert chi2 < 13.8, counts  # 99.9th percentile, 2 degrees of freedom
    # Either side of the third token's ratio to the best (0.125 / 0.5 = 0.25):
    assert set(draws(SamplingParams(temperature=1.0, min_p=0.249, seed=0), logits, 3000)) == {0, 1, 2}
    assert set(draws(SamplingParams(temperature=1.0, min_p=0.251, seed=0), logits, 3000)) == {0, 1}


def test_min_p_follows_temperature_and_combines_with_top_k_and_top_p():
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    logits = np.log(probs).astype(np.float32)
    # Cooler: ratios to the best shrink (0.3/0.4 -> 0.5625 at T=0.5), so min-p 0.6 keeps only the best.
    assert set(draws(SamplingParams(temperature=0.5, min_p=0.6, seed=1), logits, 2000)) == {0}
    assert set(draws(SamplingParams(temperature=1.0, min_p=0.6, seed=1), logits, 2000)) == {0, 1}
    # With top-k the kept ids are still the original ones, not positions in the shortlist.
    shuffled = logits[[2, 0, 3, 1]]  # ids 1 and 3 are now the best two
    assert set(draws(SamplingParams(temperature=1.0, top_k=3, min_p=0.6, seed=1), shuffled, 2000)) == {1, 3}
    # top-p 0.75 keeps {0, 1, 2}; min-p 0.6 then drops 2 (0.2 / 0.4 = 0.5).
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.75, min_p=0.6, seed=1), logits, 2000)) == {0, 1}
    # The best token always survives, however high min-p is.
    assert set(draws(SamplingParams(temperature=1.0, min_p=0.99, seed=1), logits, 200)) == {0}


def test_presence_and_frequency_penalties():
    logits = np.zeros(10, dtype=np.float32)
    logits[3], logits[5] = 2.0, 1.5
    recent = [3, 3, 3, 8]
    # presence: 2.0 - 0.6 = 1.4 < 1.5, whatever the count
    assert Sampler(SamplingParams(presence_penalty=0.6)).sample(logits, recent) == 5
    assert Sampler(SamplingParams(presence_penalty=0.4)).sample(logits, recent) == 3
    # frequency: per occurrence, 2.0 - 3 * 0.2 = 1.4 < 1.5, but one occurrence (1.8) is not enough
    assert Sampler(SamplingParams(frequency_penalty=0.2)).sample(logits, recent) == 5
    assert Sampler(SamplingParams(frequency_penalty=0.2)).sample(logits, [3]) == 3
    # counted within repeat_last_n only; a negative penalty encourages repetition
    assert Sampler(SamplingParams(frequency_penalty=0.2, repeat_last_n=2)).sample(logits, recent) == 3
    assert Sampler(SamplingParams(presence_penalty=-1.0)).sample(logits, [5]) == 5
    assert logits[3] == 2.0  # the caller's array is untouched


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.5, 0), (1.5, 4)])
def test_distribution_matches_softmax(temperature, top_k):
    logits = np.array([1.0, 0.2, -0.5, 2.0, 0.0, -1.5], dtype=np.float32)
    expected = softmax(logits.astype(np.float64), temperature)
    if top_k:
        expected[np.argsort(-logits)[top_k:]] = 0
        expected /= expected.sum()
    n = 20000
    counts = np.bincount(draws(SamplingParams(temperature=temperature, top_k=top_k, seed=11), logits, n),
                         minlength=logits.size)
    support = expected > 0
    assert (counts[~support] == 0).all()
    chi2 = (((counts - n * expected) ** 2)[support] / (n * expected[support])).sum()
    # 99.9th percentile of chi-square with <= 5 degrees of freedom is about 20.5
    assert chi2 < 20.5, (chi2, counts, n * expected)


def test_handles_masked_logits():
    logits = np.full(10, -np.inf, dtype=np.float32)
    logits[[2, 6]] = [0.0, 0.1]
    got = set(draws(SamplingParams(temperature=1.0, top_p=0.9, seed=0), logits, 200))
    assert got <= {2, 6} and got
    with pytest.raises(ValueError, match="finite"):
        Sampler(SamplingParams(temperature=1.0)).sample(np.full(4, -np.inf, dtype=np.float32))


def test_rejects_bad_logits_shape():
    with pytest.raises(ValueError, match="1-D"):
        Sampler(SamplingParams()).sample(np.zeros((2, 3), dtype=np.float32))


def test_full_vocab_sampling_is_fast():
    import time

    logits = random_logits(5)
    s = Sampler(SamplingParams(temperature=0.8, top_k=40, top_p=0.95, repeat_penalty=1.1, seed=0))
    recent = list(range(64))
    start = time.perf_counter()
    for _ in range(200):
        s.sample(logits, recent)
    # ~0.5 ms per token on a slow core; generous bound keeps this from flaking on a busy machine
    assert (time.perf_counter() - start) / 200 < 0.01
