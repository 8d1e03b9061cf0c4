"""The app's settings, kept in an INI file in the data folder via QSettings.

AppSettings is made of the engine's own records rather than copies of their fields: the model, the build
settings (engine.config.BuildSettings: a change rebuilds the compiled module) and the chat options (how the
next replies are generated), whose sampling overrides are made from the sampler's table of options. The
file stays flat, one key per field under the field's own name (sinks, top_k, seed, ...).

Only what the user chose is stored. A sampling field left as None follows the loaded model's defaults
(engine.run.generation: the checkpoint's recommendation, else Eddy's chat defaults), so changing the model
changes it; any other field equal to its default is not written either, so a later release's better
default reaches everyone who never touched it.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable

from PySide6.QtCore import QSettings

from engine.config import PIN_SLOTS, BuildSettings
from engine.run.generation import SAMPLING_FIELDS, ChatDefaults, SamplingOverrides
from engine.run.sampling import OPTIONS
from engine.run.session import ChatSettings

from .worker_payloads import ChatConfig

SETTINGS_FILE = "settings.ini"
# 1: every field saved, sampling greedy by default. 2: only the fields the user set.
SETTINGS_VERSION = 2
VERSION_KEY = "settings_version"


@dataclass(frozen=True)
class ChatOptions:
    """How replies are generated. The engine's ChatSettings is made from these once the model's sampling
    defaults are known (chat_settings; the worker does the same from chat_config)."""

    system_prompt: str = ""
    pin_system: bool = ChatSettings.pin_system  # the system prompt stays in the cache as sinks (a build choice too)
    max_new_tokens: int = ChatSettings.max_new_tokens
    seed: int = -1  # -1 = a fresh seed every reply (the engine's None)
    sampling: SamplingOverrides = SamplingOverrides()  # None = the model's default (see engine.run.generation)


@dataclass(frozen=True)
class ServerOptions:
    """The local server (app/local_server.py): `eddy serve`'s API over the window's own engine, loopback only."""

    serve: bool = False
    server_port: int = 8080
    server_key: str = ""  # "" = no key; else clients send "Authorization: Bearer KEY" (as `eddy serve --api-key`)


@dataclass(frozen=True)
class ToolOptions:
    """The window's tools (the MCP servers themselves are in the data folder's mcp.json, app/tool_cards.py)."""

    allowed_tools: str = ""  # tools that run without asking ("Always allow"), comma-separated


@dataclass(frozen=True)
class AppSettings:
    model: str = ""  # "" = the default model; else a built-in name, a .gguf file, a Hugging Face folder or a URL
    api_key: str = ""  # a remote model's (an http(s)://.../v1 URL as the model); "" = none, or $EDDY_API_KEY
    context: int = 0  # a remote model's context, over what its server says (0: the server's, else 4096)
    model_folders: str = ""  # folders of the user's own models, "|"-separated (the picker looks there too)
    recent_models: str = ""  # the models used lately, newest first, "|"-separated (the picker lists them first)
    build: BuildSettings = BuildSettings()  # its max_sinks is not the app's: pin_system decides it
    chat: ChatOptions = ChatOptions()
    server: ServerOptions = ServerOptions()
    tools: ToolOptions = ToolOptions()

    @classmethod
    def of(cls, **values: Any) -> "AppSettings":
        """From flat names, the settings file's keys (window=..., top_k=...); the others take their defaults.
        Raises TypeError for an unknown name, ValueError for a build value out of range."""
        out = cls()
        for name, value in values.items():
            out = _with(out, name, value)
        return out

    def flat(self) -> dict[str, Any]:
        """Every value by its flat name (the settings file's keys)."""
        return {name: getattr(self._part(where), name) for name, where in _WHERE.items()}

    def _part(self, where: tuple[str, ...]) -> Any:
        part: Any = self
        for attr in where:
            part = getattr(part, attr)
        return part

    @property
    def system_prompt(self) -> str:
        return self.chat.system_prompt

    def build_settings(self) -> BuildSettings:
        return replace(self.build, max_sinks=PIN_SLOTS if self.chat.pin_system else 0)

    def sampling_overrides(self) -> dict[str, Any]:
        """The sampling values the user chose (the rest follow the model)."""
        return self.chat.sampling.chosen()

    def chat_settings(self, defaults: ChatDefaults | None = None) -> ChatSettings:
        return self.chat_config().chat_settings(defaults)

    def chat_config(self) -> ChatConfig:
        """What the worker makes ChatSettings from once it knows the model's defaults (the controller adds the
        open chat's own prompt and the tools)."""
        c = self.chat
        return ChatConfig(system_prompt=c.system_prompt.strip() or None, pin_system=c.pin_system,
                          max_new_tokens=c.max_new_tokens, overrides=self.sampling_overrides(),
                          seed=None if c.seed < 0 else c.seed, api_key=self.api_key, context=self.context)

    def validate(self) -> None:
        """Raises ValueError with a message for the user if any value is out of range."""
        self.build_settings()  # BuildSettings checks its own ranges
        self.chat_settings()   # and so does SamplingParams
        if self.chat.max_new_tokens < 1:
            raise ValueError("max new tokens must be at least 1")
        if not 1 <= self.server.server_port <= 65535:
            raise ValueError("the server's port must be between 1 and 65535")

    def needs_rebuild(self, other: "AppSettings") -> bool:
        # build_settings() holds pin_system too, as the sink slots it compiles.
        return (self.model != other.model or self.api_key != other.api_key or self.context != other.context
                # (a remote model reconnects)
                or self.build_settings() != other.build_settings())

    def user_set(self) -> dict[str, Any]:
        """The values that differ from a fresh install's: what is stored."""
        fresh = AppSettings().flat()
        return {k: v for k, v in self.flat().items() if v is not None and v != fresh[k]}


def _where() -> dict[str, tuple[str, ...]]:
    """Each flat name and the attributes that lead to its part of AppSettings."""
    pairs = [("model", ()), ("api_key", ()), ("context", ()), ("model_folders", ()), ("recent_models", ())]
    pairs += [(f.name, ("build",)) for f in fields(BuildSettings) if f.name != "max_sinks"]
    pairs += [(f.name, ("chat",)) for f in fields(ChatOptions) if f.name != "sampling"]
    pairs += [(name, ("chat", "sampling")) for name in SAMPLING_FIELDS]
    pairs += [(f.name, ("server",)) for f in fields(ServerOptions)]
    pairs += [(f.name, ("tools",)) for f in fields(ToolOptions)]
    out = dict(pairs)
    if len(out) != len(pairs):  # the file is flat: a sampler option named like a build field would share its key
        raise RuntimeError("two settings share a name in the settings file")
    return out


_WHERE = _where()


def _with(settings: Any, name: str, value: Any, where: tuple[str, ...] | None = None) -> Any:
    """`settings` with the flat-named value replaced, down through the parts that hold it."""
    if where is None:
        if name not in _WHERE:
            raise TypeError(f"unknown setting {name!r}")
        where = _WHERE[name]
    if not where:
        return replace(settings, **{name: value})
    return replace(settings, **{where[0]: _with(getattr(settings, where[0]), name, value, where[1:])})


# What version 1 wrote for a field nobody touched (it saved every field): such a value counts as untouched.
_V1_DEFAULTS: dict[str, Any] = {
    "model": "", "sinks": 4, "window": 1020, "dtype": "q8", "device": "cpu", "max_chunk": 512, "system_prompt": "",
    "max_new_tokens": 512, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "repeat_penalty": 1.0,
    "repeat_last_n": 64, "seed": -1,
}


def _field_type(name: str) -> Callable[[Any], Any]:
    if name in OPTIONS:
        return OPTIONS[name].kind  # the default is None: the type is the option's
    kind = type(AppSettings().flat()[name])
    return _boolean if kind is bool else _text if kind is str else kind


def _text(value: Any) -> str:
    # The INI format reads a value with a comma in it (a key may hold one) back as a list of its parts.
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


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
    for name in _WHERE:
        if not qs.contains(name):
            continue
        try:
            value = _field_type(name)(qs.value(name))
        except (TypeError, ValueError):
            continue
        if version < 2 and name in _V1_DEFAULTS and value == _V1_DEFAULTS[name]:
            continue
        values[name] = value
    settings = _valid(values)
    if version < SETTINGS_VERSION and qs.allKeys():
        save_settings(data_dir, settings)
    return settings


def _valid(values: dict[str, Any]) -> AppSettings:
    try:
        settings = AppSettings.of(**values)
        settings.validate()
        return settings
    except (TypeError, ValueError):
        pass
    # A hand-edited file with a bad value must not stop the app from starting: fall back field by field.
    good = AppSettings()
    for name, value in values.items():
        try:
            trial = _with(good, name, value)  # a build value is checked here, as BuildSettings is made
            trial.validate()
            good = trial
        except (TypeError, ValueError):
            pass
    return good


def save_settings(data_dir: Path, settings: AppSettings) -> None:
    qs = QSettings(str(data_dir / SETTINGS_FILE), QSettings.Format.IniFormat)
    chosen = settings.user_set()
    for name in _WHERE:
        if name in chosen:
            qs.setValue(name, chosen[name])
        else:
            qs.remove(name)
    qs.setValue(VERSION_KEY, SETTINGS_VERSION)
    qs.sync()
