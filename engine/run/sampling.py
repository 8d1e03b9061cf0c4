"""Next-token sampling from a logits vector: greedy, temperature, top-k, top-p, min-p, a llama.cpp-style repeat
penalty and OpenAI-style presence/frequency penalties.

The order is transformers' (penalties, then top-k, temperature, top-p, min-p): min-p compares probabilities
after temperature, as its MinPLogitsWarper does, so a hotter temperature lets more tokens through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import islice
from typing import Sequence

import numpy as np

# top-p without top-k first looks at this many best tokens and sorts everything only if they hold too little
# mass, so the usual peaked case never sorts the whole vocabulary.
_TOP_P_FIRST_LOOK = 64


@dataclass
class SamplingParams:
    temperature: float = 0.0     # 0 => greedy
    top_k: int = 0               # 0 => off
    top_p: float = 1.0           # 1 => off
    min_p: float = 0.0           # 0 => off; drop tokens less likely than min_p x the most likely one
    repeat_penalty: float = 1.0  # 1 => off; logits of tokens in `recent` divided by penalty if >0 else multiplied
    presence_penalty: float = 0.0   # 0 => off; subtracted once from the logit of every token in `recent`
    frequency_penalty: float = 0.0  # 0 => off; subtracted per occurrence in `recent`
    repeat_last_n: int = 64      # how many recent tokens every penalty looks at
    seed: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not (0 <= self.min_p < 1):
            raise ValueError(f"min_p must be in [0, 1) (0 = off), got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2 <= value <= 2):  # the OpenAI API's range
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {value}")
        if not (math.isfinite(self.repeat_penalty) and self.repeat_penalty > 0):
            raise ValueError(f"repeat_penalty must be a finite number > 0 (1 = off), got {self.repeat_penalty}")
        if isinstance(self.repeat_last_n, bool) or not isinstance(self.repeat_last_n, int) or self.repeat_last_n < 0:
            raise ValueError(f"repeat_last_n must be an integer >= 0, got {self.repeat_last_n!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be None or an integer >= 0, got {self.seed!r}")


class Sampler:
    def __init__(self, params: SamplingParams) -> None:
        params.validate()  # the dataclass is mutable, so check again at the point of use
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def sample(self, logits: np.ndarray, recent: Sequence[int] = ()) -> int:
        p = self.params
        if logits.ndim != 1 or logits.size == 0:
            raise ValueError(f"logits must be a non-empty 1-D array, got shape {logits.shape}")
        logits = self._penalise(logits, recent)
        if p.temperature == 0 or p.top_k == 1:
            return int(np.argmax(logits))

        ids: np.ndarray | None = None  # None: every token is a candidate
        if 0 < p.top_k < logits.size:
            ids = np.argpartition(logits, -p.top_k)[-p.top_k:]
            logits = logits[ids]
        probs = _softmax(logits, p.temperature)
        if p.top_p < 1:
            keep = _nucleus(probs, p.top_p)
            ids = keep if ids is None else ids[keep]
            probs = probs[keep]
        if p.min_p > 0:
            # Relative to the best token, so renormalising after top-p changes nothing; the best always stays.
            keep = np.flatnonzero(probs >= p.min_p * probs.max())
            ids = keep if ids is None else ids[keep]
            probs = probs[keep]

        cum = np.cumsum(probs)
        pick = min(int(np.searchsorted(cum, self._rng.random() * cum[-1], side="right")), len(cum) - 1)
        return int(pick if ids is None else ids[pick])

    def _penalise(self, logits: np.ndarray, recent: Sequence[int]) -> np.ndarray:
        p = self.params
        off = p.repeat_penalty == 1 and p.presence_penalty == 0 and p.frequency_penalty == 0
        if off or p.repeat_last_n == 0 or len(recent) == 0:
            return logits
        # reversed + islice: touches only the window, and works for a deque (which cannot be sliced) too
        window = np.fromiter(islice(reversed(recent), p.repeat_last_n), dtype=np.int64)
        seen, counts = np.unique(window, return_counts=True)
        inside = (seen >= 0) & (seen < logits.size)
        seen, counts = seen[inside], counts[inside]
        out = logits.copy()  # never modify the caller's array
        vals = out[seen]
        if p.repeat_penalty != 1:
            vals = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
        out[seen] = vals - p.presence_penalty - p.frequency_penalty * counts
        return out


def _softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    # float64 so a tiny temperature (huge scaled logits) neither overflows nor collapses to NaN
    x = logits.astype(np.float64) / temperature
    top = x.max()
    if not np.isfinite(top):
        raise ValueError("logits have no finite maximum")
    e = np.exp(x - top)
    return e / e.sum()


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Indices (most probable first) of the smallest set whose probability reaches top_p."""
    k = min(_TOP_P_FIRST_LOOK, probs.size)
    best = np.argpartition(probs, -k)[-k:]
    best = best[np.argsort(-probs[best], kind="stable")]
    cum = np.cumsum(probs[best])
    if cum[-1] < top_p:
        # Tokens below (1 - top_p) / n hold less than 1 - top_p together, so the nucleus never needs them:
        # sort only the rest (indices stay ascending, so ties break towards the lower id as in a stable sort).
        best = np.flatnonzero(probs >= (1 - top_p) / probs.size)
        best = best[np.argsort(-probs[best], kind="stable")]
        cum = np.cumsum(probs[best])
    return best[: min(int(np.searchsorted(cum, top_p)) + 1, best.size)]
