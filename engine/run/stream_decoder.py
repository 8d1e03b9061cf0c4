"""Streaming detokenisation: token ids in one at a time, text out without broken characters."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .tokenizer import Tokenizer


class StreamDecoder:
    """Incremental detokenisation: push token ids one at a time, get text deltas that never contain broken UTF-8
    (a partial multi-byte character is held back, U+FFFD never emitted for an incomplete sequence), and whose
    concatenation equals tokenizer.decode(all ids) exactly (including special tokens as text, e.g. '<|im_end|>')."""

    # The window is trimmed back to _KEEP tokens of left context once it exceeds _MAX, so a push costs O(1).
    _KEEP = 6
    _MAX = 24

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._decode = tokenizer.decode
        self._ids: list[int] = []
        self._emitted = 0  # characters of decode(self._ids) already handed out

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._decode(self._ids)
        # Only trailing U+FFFD can still change (an unfinished byte sequence; with byte-fallback vocabularies a
        # whole run of them), so hold those back and hand out everything before.
        stable = len(text.rstrip("\ufffd"))
        out = text[self._emitted:stable]
        self._emitted = max(self._emitted, stable)
        if len(self._ids) > self._MAX:
            self._trim(text)
        return out

    def flush(self) -> str:
        out = self._decode(self._ids)[self._emitted:]
        self._ids, self._emitted = [], 0
        return out

    def _trim(self, text: str) -> None:
        # Dropping leading ids is safe where the shorter window decodes to an exact suffix of the current text
        # (not mid-character, decoder in step) that still covers everything not yet handed out.
        pending = len(text) - self._emitted
        # A few candidates suffice: in ordinary text a clean boundary is never far away; else retry next push.
        first = len(self._ids) - self._KEEP
        for start in range(first, max(first - 8, 0), -1):
            rest = self._decode(self._ids[start:])
            if len(rest) >= pending and text.endswith(rest):
                self._ids = self._ids[start:]
                self._emitted = len(rest) - pending
                return
