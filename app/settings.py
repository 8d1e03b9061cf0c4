"""The app's settings: one plain dataclass, kept in an INI file in the data folder via QSettings.

Two groups matter to the rest of the app: the build fields change the compiled module (a rebuild), the
chat fields only change how the next replies are generated.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from PySide6.QtCore import QSettings

from engine.config import DEVICES, DTYPES, BuildSettings
from engine.run.sampling import SamplingParams
from engine.run.session import ChatSettings

BUILD_FIELDS = ("model", "sinks", "window", "dtype", "device", "max_chunk")
SETTINGS_FILE = "settings.ini"


@dataclass(frozen=True)
class AppSettings:
    model: str = ""  # "" = the default model; else a built-in name, a .gguf file or a Hugging Face folder
    sinks: int = BuildSettings.sinks
    window: int = BuildSettings.window
    dtype: str = BuildSettings.dtype
    device: str = BuildSettings.device
    max_chunk: int = BuildSettings.max_chunk
    system_prompt: str = ""
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int = -1  # -1 = a fresh seed every reply

    def build_settings(self) -> BuildSettings:
        return BuildSettings(sinks=self.sinks, window=self.window, dtype=self.dtype, device=self.device,
                             max_chunk=self.max_chunk)

    def chat_settings(self) -> ChatSettings:
        sampling = SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                  repeat_penalty=self.repeat_penalty, repeat_last_n=self.repeat_last_n,
                                  seed=None if self.seed < 0 else self.seed)
        return ChatSettings(system_prompt=self.system_prompt.strip() or None,
                            max_new_tokens=self.max_new_tokens, sampling=sampling)

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


def load_settings(data_dir: Path) -> AppSettings:
    """Reads the INI file; a missing or unreadable value falls back to its default (never raises)."""
    qs = QSettings(str(data_dir / SETTINGS_FILE), QSettings.Format.IniFormat)
    defaults = AppSettings()
    values: dict[str, Any] = {}
    for f in fields(AppSettings):
        default = getattr(defaults, f.name)
        raw = qs.value(f.name, default)
        try:
            values[f.name] = type(default)(raw) if raw is not None else default
        except (TypeError, ValueError):
            values[f.name] = default
    settings = AppSettings(**values)
    try:
        settings.validate()
    except ValueError:
        # A hand-edited file with a bad value must not stop the app from starting: fall back field by field.
        good = AppSettings()
        for name, value in values.items():
            trial = replace(good, **{name: value})
            try:
                trial.validate()
                good = trial
            except ValueError:
                pass
        settings = good
    if settings.dtype not in DTYPES or settings.device not in DEVICES:
        settings = replace(settings, dtype=defaults.dtype, device=defaults.device)
    return settings


def save_settings(data_dir: Path, settings: AppSettings) -> None:
    qs = QSettings(str(data_dir / SETTINGS_FILE), QSettings.Format.IniFormat)
    for name, value in settings.to_dict().items():
        qs.setValue(name, value)
    qs.sync()
