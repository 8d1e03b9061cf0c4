"""The app's settings: one plain dataclass, kept in an INI file in the data folder via QSettings.

Two groups matter to the rest of the app: the build fields change the compiled module (a rebuild), the
chat fields only change how the next replies are generated.

Only what the user chose is stored. A sampling field left as None follows the loaded model's defaults
(engine.run.generation: the checkpoint's recommendation, else Eddy's chat defaults), so changing the model
changes it; any other field equal to its default is not written either, so a later release's better
default reaches everyone who never touched it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable

from PySide6.QtCore import QSettings

from engine.config import DEVICES, DTYPES, PIN_SLOTS, BuildSettings
from engine.run.generation import SAMPLING_FIELDS, ChatDefaults, sampling_params
from engine.run.sampling import SamplingParams
from engine.run.session import ChatSettings

# pin_system is also a build field: a pinning build compiles PIN_SLOTS sink slots.
BUILD_FIELDS = ("model", "sinks", "window", "dtype", "device", "max_chunk", "pin_system")
SETTINGS_FILE = "settings.ini"
# 1: every field saved, sampling greedy by default. 2: only the fields the user set.
SETTINGS_VERSION = 2
VERSION_KEY = "settings_version"


@dataclass(frozen=True)
class AppSettings:
    model: str = ""  # "" = the default model; else a built-in name, a .gguf file or a Hugging Face folder
    sinks: int = BuildSettings.sinks
    window: int = BuildSettings.window
    dtype: str = BuildSettings.dtype
    device: str = BuildSettings.device
    max_chunk: int = BuildSettings.max_chunk
    system_prompt: str = ""
    pin_system: bool = False  # the system prompt stays in the cache as sinks, however long the chat
    max_new_tokens: int = 512
    # Sampling: None = the model's default (see engine.run.generation).
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repeat_last_n: int | None = None
    seed: int = -1  # -1 = a fresh seed every reply

    def build_settings(self) -> BuildSettings:
        return BuildSettings(sinks=self.sinks, window=self.window, dtype=self.dtype, device=self.device,
                             max_chunk=self.max_chunk, max_sinks=PIN_SLOTS if self.pin_system else 0)

    def sampling_overrides(self) -> dict[str, Any]:
        """The sampling values the user chose (the rest follow the model)."""
        return {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}

    def chat_settings(self, defaults: ChatDefaults | None = None) -> ChatSettings:
        sampling = sampling_params(defaults or ChatDefaults(), self.sampling_overrides(),
                                   None if self.seed < 0 else self.seed)
        return ChatSettings(system_prompt=self.system_prompt.strip() or None,
                            max_new_tokens=self.max_new_tokens, sampling=sampling, pin_system=self.pin_system)

    def chat_dict(self) -> dict[str, Any]:
        """What the worker needs to make ChatSettings once it knows the model's defaults (plain data: it
        crosses threads in a queued signal)."""
        return {"system_prompt": self.system_prompt.strip() or None, "pin_system": self.pin_system,
                "max_new_tokens": self.max_new_tokens,
                "overrides": self.sampling_overrides(), "seed": None if self.seed < 0 else self.seed}

    def validate(self) -> None:
        """Raises ValueError with a message for the user if any value is out of range."""
        self.build_settings()  # BuildSettings checks its own ranges
        self.chat_settings()   # and so does SamplingParams
        if self.max_new_tokens < 1:
            raise ValueError("max new tokens must be at least 1")

    def needs_rebuild(self, other: "AppSettings") -> bool:
        return any(getattr(self, f) != getattr(other, f) for f in BUILD_FIELDS)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def user_set(self) -> dict[str, Any]:
        """The fields that differ from a fresh install's: what is stored."""
        fresh = AppSettings()
        return {k: v for k, v in self.to_dict().items() if v is not None and v != getattr(fresh, k)}


# What version 1 wrote for a field nobody touched (it saved every field): such a value counts as untouched.
_V1_DEFAULTS: dict[str, Any] = {
    "model": "", "sinks": 4, "window": 1020, "dtype": "q8", "device": "cpu", "max_chunk": 512, "system_prompt": "",
    "max_new_tokens": 512, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "repeat_penalty": 1.0,
    "repeat_last_n": 64, "seed": -1,
}


def _field_type(name: str) -> Callable[[Any], Any]:
    if name in SAMPLING_FIELDS:
        return type(getattr(SamplingParams(), name))
    kind = type(getattr(AppSettings(), name))
    return _boolean if kind is bool else kind


def _boolean(value: Any) -> bool:
    # The INI format gives back "true"/"false" strings, and bool("false") is True.
    if isinstance(value, str):
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"not a boolean: {value!r}")
        return value.lower() in ("true", "1")
    return bool(value)


def load_settings(data_dir: Path) -> AppSettings:
    """Reads the INI file; a missing or unreadable value falls back to its default (never raises).

    A version-1 file is migrated in place: values equal to version 1's defaults are dropped, so the old
    greedy sampling of a user who never changed it gives way to the model's defaults."""
    qs = QSettings(str(data_dir / SETTINGS_FILE), QSettings.Format.IniFormat)
    try:
        version = int(qs.value(VERSION_KEY, 1))
    except (TypeError, ValueError):
        version = 1
    values: dict[str, Any] = {}
    for f in fields(AppSettings):
        if not qs.contains(f.name):
            continue
        try:
            value = _field_type(f.name)(qs.value(f.name))
        except (TypeError, ValueError):
            continue
        if version < 2 and f.name in _V1_DEFAULTS and value == _V1_DEFAULTS[f.name]:
            continue
        values[f.name] = value
    settings = _valid(values)
    if settings.dtype not in DTYPES or settings.device not in DEVICES:
        settings = replace(settings, dtype=AppSettings.dtype, device=AppSettings.device)
    if version < SETTINGS_VERSION and qs.allKeys():
        save_settings(data_dir, settings)
    return settings


def _valid(values: dict[str, Any]) -> AppSettings:
    try:
        settings = AppSettings(**values)
        settings.validate()
        return settings
    except (TypeError, ValueError):
        pass
    # A hand-edited file with a bad value must not stop the app from starting: fall back field by field.
    good = AppSettings()
    for name, value in values.items():
        trial = replace(good, **{name: value})
        try:
            trial.validate()
            good = trial
        except (TypeError, ValueError):
            pass
    return good


def save_settings(data_dir: Path, settings: AppSettings) -> None:
    qs = QSettings(str(data_dir / SETTINGS_FILE), QSettings.Format.IniFormat)
    chosen = settings.user_set()
    for f in fields(AppSettings):
        if f.name in chosen:
            qs.setValue(f.name, chosen[f.name])
        else:
            qs.remove(f.name)
    qs.setValue(VERSION_KEY, SETTINGS_VERSION)
    qs.sync()
