"""Next-token sampling from a logits vector: greedy, temperature, top-k, top-p, min-p, a llama.cpp-style repeat
penalty and OpenAI-style presence/frequency penalties.

The order is transformers' (penalties, then top-k, temperature, top-p, min-p): min-p compares probabilities
after temperature, as its MinPLogitsWarper does, so a hotter temperature lets more tokens through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from itertools import islice
from typing import Any, Sequence

import numpy as np

# top-p without top-k first looks at this many best tokens and sorts everything only if they hold too little
# mass, so the usual peaked case never sorts the whole vocabulary.
_TOP_P_FIRST_LOOK = 64


@dataclass(frozen=True)
class Option:
    """How one sampling field is offered to the user. The app's settings dialog and settings file and the
    flags of `eddy chat` are all made from these, so a new option is declared once, on its field."""

    kind: type     # int or float: the flag's type, the dialog's spin box
    label: str     # the dialog's row; the flag is the field's name (top_k: --top-k)
    help: str      # the flag's help and the row's tooltip
    low: float     # the dialog's range; validate() holds the sampler's own limits
    high: float
    step: float = 1.0
    decimals: int = 2
    off: str = ""  # what the dialog shows at `low` when that value turns the option off


def _option(default: float, label: str, help: str, low: float, high: float, **how: Any) -> Any:
    return field(default=default, metadata={"option": Option(type(default), label, help, low, high, **how)})


@dataclass
class SamplingParams:
    temperature: float = _option(0.0, "Temperature", "0 = greedy, always the most likely token", 0.0, 5.0,
                                 step=0.1)
    top_k: int = _option(0, "Top-k", "keep the k most likely tokens, 0 = off", 0, 100000, off="off")
    top_p: float = _option(1.0, "Top-p", "keep the smallest set holding this probability, 1 = off", 0.01, 1.0,
                           step=0.05)
    min_p: float = _option(0.0, "Min-p", "drop tokens less likely than this times the most likely one, 0 = off",
                           0.0, 0.99, step=0.01, decimals=3, off="off")
    # Logits of tokens in `recent` divided by the penalty if > 0, else multiplied (llama.cpp's).
    repeat_penalty: float = _option(1.0, "Repeat penalty", "divide the logits of recent tokens by this, 1 = off",
                                    0.5, 3.0, step=0.05)
    presence_penalty: float = _option(0.0, "Presence penalty",
                                      "subtract this from the logits of recent tokens, 0 = off", -2.0, 2.0, step=0.1)
    frequency_penalty: float = _option(0.0, "Frequency penalty", "subtract this per recent occurrence, 0 = off",
                                       -2.0, 2.0, step=0.1)
    repeat_last_n: int = _option(64, "Repeat window", "how many recent tokens the penalties look at", 0, 4096)
    # Not an option: the seed is the caller's alone (a model recommends none; the app's -1 means a fresh one).
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


# The options in the dialog's order: what a model's defaults decide and a user may override.
OPTIONS: dict[str, Option] = {f.name: f.metadata["option"] for f in fields(SamplingParams) if "option" in f.metadata}


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
            ids = largest(logits, p.top_k)
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


# Logits per block in largest's first pass.
_TOP_K_BLOCK = 64


def largest(logits: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest logits, in no particular order. The k-th largest of the blocks' maxima is a floor
    under the k largest (those k maxima are k logits at or above it), so only the logits at or above it are
    partitioned: ~0.05 ms for 49k logits and k = 40, where a partition of them all took ~0.4 ms a token."""
    n = logits.size - logits.size % _TOP_K_BLOCK
    if n // _TOP_K_BLOCK > 4 * k:
        floor = np.partition(logits[:n].reshape(-1, _TOP_K_BLOCK).max(axis=1), -k)[-k]
        candidates = np.flatnonzero(logits >= floor)
        if candidates.size >= k:  # fewer only with NaNs, which compare false: the full partition handles them
            return candidates[np.argpartition(logits[candidates], -k)[-k:]]
    return np.argpartition(logits, -k)[-k:]


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
