"""Rotary-embedding tables, computed on the host in float64.

The module receives cos/sin for each new token instead of computing them from a position, so angles stay
exact however far a conversation runs (float32 positions lose precision after ~1e5 tokens).
"""
from __future__ import annotations

import math

import numpy as np

from ..config import ModelConfig
from ..errors import ModelError


def inv_freqs(cfg: ModelConfig) -> list[np.ndarray]:
    """The frequencies of each RoPE table the module takes, in ModelConfig.rope_table order: the model's own,
    then (Gemma 3) the local layers', which have their own base and no scaling."""
    freqs = [inv_freq(cfg)]
    if cfg.rope_tables == 2:
        freqs.append(_base(cfg.rope_local_theta, cfg.head_dim))
    return freqs


def _base(theta: float, d: int) -> np.ndarray:
    return 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))


def inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Per-pair rotation frequencies [head_dim/2], with the model's rope scaling applied."""
    freq = _base(cfg.rope_theta, cfg.head_dim)
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return freq
    if kind == "linear":
        return freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / freq
        scaled = np.where(wavelen > low_wavelen, freq / factor, freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled)
    raise ModelError(f"rope scaling type {kind!r} is not supported (Eddy supports default, linear and llama3)")


def tables(freq: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [len(positions), head_dim/2] as float32."""
    angles = np.outer(np.asarray(positions, dtype=np.float64), freq)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def module_tables(freqs: list[np.ndarray], positions: np.ndarray) -> np.ndarray:
    """The module's `rope` input: [tables, 2 (cos, sin), len(positions), head_dim/2]."""
    return np.stack([np.stack(tables(f, positions)) for f in freqs])
