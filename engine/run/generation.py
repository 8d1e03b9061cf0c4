"""Chat sampling defaults: what a checkpoint recommends, else Eddy's own, measured on the default model.

A checkpoint may say how it likes to be sampled: `generation_config.json` in a Hugging Face folder, the
`general.sampling.*` keys in a GGUF file. Those values win; fields it leaves out take Eddy's chat defaults,
which were chosen with bench/reply_quality.py on a tuning set of prompts (docs/QUALITY.md). Greedy decoding
(SamplingParams() as it is) stays the default for scripts and benchmarks: `eddy chat` without
`--chat-defaults`.

Run side: no torch. GGUF metadata is read with the `gguf` package (a memory map; no tensor is touched).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any, Mapping

from .sampling import OPTIONS, SamplingParams

# The fields a model's defaults decide (the seed and the reply length are the user's alone).
SAMPLING_FIELDS = tuple(OPTIONS)

# Eddy's chat defaults for a checkpoint that recommends nothing (docs/QUALITY.md has the measurement); an
# option not named here samples as the sampler's own default has it (off, for the penalties).
_MEASURED = {"temperature": 0.7, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.1}
EDDY_CHAT_DEFAULTS: dict[str, Any] = {
    **{name: getattr(SamplingParams(), name) for name in SAMPLING_FIELDS}, **_MEASURED}


def _chosen(self: Any) -> dict[str, Any]:
    """The values set (not None): what sampling_params lays over the model's defaults."""
    return {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}


# The user's own sampling values, None = follow the loaded model's default: one field per sampler option, made
# from SamplingParams so an option is never declared twice (a type checker sees no fields; replace() and
# fields() do).
SamplingOverrides = make_dataclass(
    "SamplingOverrides", [(name, f"{o.kind.__name__} | None", field(default=None)) for name, o in OPTIONS.items()],
    frozen=True, namespace={"chosen": _chosen, "__module__": __name__})

# Where each field comes from in the two formats; the value's type is its Option's.
_HF_KEYS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
            "repetition_penalty": "repeat_penalty"}
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
              "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repeat_penalty",
              "general.sampling.penalty_last_n": "repeat_last_n"}


@dataclass(frozen=True)
class ChatDefaults:
    """The sampling defaults in force for one model, and which of them the checkpoint itself chose."""

    values: dict[str, Any] = field(default_factory=lambda: dict(EDDY_CHAT_DEFAULTS))
    from_model: dict[str, Any] = field(default_factory=dict)
    origin: str = ""  # "generation_config.json", "GGUF metadata" or "" (nothing recommended)

    def describe(self) -> str:
        """One line for the user: where the defaults in force come from."""
        if not self.from_model:
            return "Eddy's chat defaults (the model recommends none)"
        names = ", ".join(f"{k.replace('_', ' ')} {_fmt(v)}" for k, v in self.from_model.items())
        return f"the model's own {names} (from its {self.origin}); Eddy's defaults for the rest"

    def to_dict(self) -> dict[str, Any]:
        return {"values": dict(self.values), "from_model": dict(self.from_model), "origin": self.origin}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ChatDefaults":
        return cls(dict(d.get("values") or EDDY_CHAT_DEFAULTS), dict(d.get("from_model") or {}),
                   str(d.get("origin") or ""))


def chat_defaults(recommended: Mapping[str, Any] | None = None, origin: str = "") -> ChatDefaults:
    """Eddy's defaults overlaid with what a checkpoint recommends (values it gives that are out of range
    are dropped, so a strange file never stops a chat)."""
    good: dict[str, Any] = {}
    for name, value in (recommended or {}).items():
        try:
            SamplingParams(**{name: value})
        except (TypeError, ValueError):
            continue
        good[name] = value
    return ChatDefaults({**EDDY_CHAT_DEFAULTS, **good}, good, origin if good else "")


def sampling_params(defaults: ChatDefaults, overrides: Mapping[str, Any] | None = None,
                    seed: int | None = None) -> SamplingParams:
    """The sampler settings for a chat: the user's own values over the model's defaults."""
    values = {**defaults.values, **{k: v for k, v in (overrides or {}).items() if v is not None}}
    known = {f.name for f in fields(SamplingParams)}
    return SamplingParams(**{k: v for k, v in values.items() if k in known}, seed=seed)


def read_recommended(kind: str, path: Path | None) -> tuple[dict[str, Any], str]:
    """(the sampling a checkpoint recommends, where it says so); ({}, "") when it says nothing.

    `kind` and `path` are a ModelSource's: "hf" (a folder), "gguf" (a file); anything else has none."""
    if path is None:
        return {}, ""
    if kind == "hf":
        return _from_generation_config(path / "generation_config.json"), "generation_config.json"
    if kind == "gguf":
        return _from_gguf(path), "GGUF metadata"
    return {}, ""


def _from_generation_config(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # absent or unreadable: no recommendation, never a failed load
    # transformers ignores every sampling field unless do_sample is true: a file with do_sample false (or
    # absent) describes greedy decoding, which is its library default rather than a chat recommendation.
    if not isinstance(raw, dict) or raw.get("do_sample") is not True:
        return {}
    out = {}
    for key, name in _HF_KEYS.items():
        value = _number(raw.get(key), OPTIONS[name].kind)
        if value is not None:
            out[name] = value
    return out


def _from_gguf(path: Path) -> dict[str, Any]:
    # The checkpoint's own header walk (memoised, and already done by resolve): gguf.GGUFReader took 6.7 s of
    # a 7.4 s start here, building numpy views of every tokenizer string.
    from ..checkpoint.gguf import read_gguf

    try:
        fields = read_gguf(path).fields
    except Exception:  # the checkpoint reader reports a damaged file with a proper message elsewhere
        return {}
    out = {}
    for key, name in _GGUF_KEYS.items():
        if key not in fields:
            continue
        value = _number(fields[key], OPTIONS[name].kind)
        if value is not None:
            out[name] = value
    return out


def _number(value: Any, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    if kind is int:
        return int(value) if float(value).is_integer() else None
    return round(float(value), 6)  # GGUF stores float32: 0.95 comes back as 0.949999988


def _fmt(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
