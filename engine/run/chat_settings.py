"""How a chat's replies are generated (ChatSettings), and the one place they are made from plain values.

The app's settings, a stored chat's options, `eddy chat`'s flags and an HTTP request all say the same few
things (a system prompt, a reply's length, the user's sampling values over the model's defaults); `make`
turns them into ChatSettings, so each caller passes what it has and none repeats the normalising.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from .constraint import Grammar
from .generation import ChatDefaults, sampling_params
from .sampling import SamplingParams

DEFAULT_MAX_NEW_TOKENS = 512


@dataclass
class ChatSettings:
    system_prompt: str | None = None
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    sampling: SamplingParams = field(default_factory=SamplingParams)
    pin_system: bool = False  # the system prompt's tokens stay in the cache as sinks (StreamingEngine.pin)
    # What the chat template is given besides the messages: `tools` (OpenAI's function list), `enable_thinking`.
    template_extras: dict | None = None
    grammar: Grammar | None = None  # the reply is held to it (engine/run/constraint.py)
    split_thinking: bool = True  # a <think> block becomes Reasoning events and TurnResult.reasoning

    @classmethod
    def make(cls, defaults: ChatDefaults | None = None, overrides: Mapping[str, Any] | None = None,
             seed: int | None = None, *, system_prompt: str | None = None,
             max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, pin_system: bool = False,
             template_extras: dict | None = None, grammar: Grammar | None = None,
             split_thinking: bool = True) -> "ChatSettings":
        """The settings for a chat: the sampling values in `overrides` (None: the default) over `defaults`
        (the model's, or Eddy's own when None). An empty system prompt, or empty extras, are none: the
        template is then given nothing rather than an empty system message. Raises ValueError, with a
        message for the user, for a sampling value out of range."""
        sampling = sampling_params(defaults or ChatDefaults(), overrides, seed)
        return cls(system_prompt=system_prompt or None, max_new_tokens=int(max_new_tokens), sampling=sampling,
                   pin_system=bool(pin_system), template_extras=template_extras or None, grammar=grammar,
                   split_thinking=split_thinking)
