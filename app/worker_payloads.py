"""What crosses the engine thread besides the engine's own events: typed, frozen values, so neither side
depends on the other's dict keys and a value sent is never reassigned while the other thread reads it. No Qt here.

GUI -> worker: ChatConfig (EngineHost.load, configure), the chat's options as plain values; the worker makes
ChatSettings from them once it knows the model's sampling defaults. Worker -> GUI: ModelInfo
(EngineWorker.loaded), the model the worker has loaded.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from engine.config import BuildSettings
from engine.events import CacheStats
from engine.run.chat_settings import DEFAULT_MAX_NEW_TOKENS, ChatSettings
from engine.run.generation import ChatDefaults


@dataclass(frozen=True)
class ChatConfig:
    """The open chat's options as the worker is told them (AppSettings.chat_config, then the controller's)."""

    system_prompt: str | None = None  # the open chat's own, else Settings' (None: no system prompt)
    pin_system: bool = False
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    overrides: Mapping[str, Any] = field(default_factory=dict)  # the sampling values chosen (the model's for the rest)
    seed: int | None = None  # None: a fresh seed every reply
    tools: tuple[dict, ...] = ()  # the MCP servers' tools, in OpenAI's format
    # "auto"; "required" or a named function ({"type": "function", ...}): a user's message is answered with calls.
    tool_choice: str | dict = "auto"
    api_key: str = ""  # a remote model's ("": none)
    context: int = 0  # a remote model's context (0: what its server says)

    def chat_settings(self, defaults: ChatDefaults | None = None) -> ChatSettings:
        """The engine's settings over the model's sampling defaults (Eddy's own before a model loads).
        Raises ValueError for a sampling value out of range."""
        return ChatSettings.make(defaults, self.overrides, self.seed, system_prompt=self.system_prompt,
                                 max_new_tokens=self.max_new_tokens, pin_system=self.pin_system)


@dataclass(frozen=True)
class ModelInfo:
    """A model the worker has loaded: what the status bar, the statistics and the local server need of it."""

    model: str  # its name: a built-in's, a file's or folder's, or the model a server runs
    folder: str  # its artefact folder, or a remote model's URL
    build: BuildSettings | None  # what its module was built with (None: a model on a server, nothing built)
    window: int  # tokens its cache's window holds (a remote model's context)
    device: str  # what the status bar names: the GPU or CPU (and why a cuda choice runs on the CPU), or the server
    seconds: float  # how long the load took
    built: bool  # it was built just now (not found in the cache)
    cache: CacheStats  # the cache once loaded
    chat_defaults: ChatDefaults = field(default_factory=ChatDefaults)  # its sampling defaults

    @property
    def remote(self) -> bool:
        """A model on an OpenAI-compatible server (engine/remote.py)."""
        return self.build is None
