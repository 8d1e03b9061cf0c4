"""A reasoning model's thinking, told apart from its answer as the reply streams.

Qwen3, the DeepSeek-R1 distills, QwQ and Phi-4-reasoning write their thinking between <think> and </think>
before the answer; Qwen3's and R1's templates open the block in the generation prompt, so the reply starts
inside it and only the closing tag is seen. A tag may arrive split over several tokens: what could be the start
of one is held back until it is clear, so neither side ever shows a piece of a tag.
"""
from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ThinkSplitter:
    """push(text) -> [(kind, text)], kind "reasoning" or "content"; flush() at the end of the reply."""

    def __init__(self, inside: bool = False) -> None:
        # Only the reply's very first characters may open a block; anywhere else "<think>" is just text.
        self.state = "thinking" if inside else "start"
        self.pending = ""
        self.reasoning: list[str] = []
        self.content: list[str] = []

    def push(self, text: str) -> list[tuple[str, str]]:
        self.pending += text
        out: list[tuple[str, str]] = []
        while self.pending:
            if self.state == "start":
                if self.pending.startswith(THINK_OPEN):
                    self.pending, self.state = self.pending[len(THINK_OPEN):], "thinking"
                    continue
                if THINK_OPEN.startswith(self.pending):
                    break  # a tag in the making
                self.state = "answer"
                continue
            if self.state == "after":
                # The blank lines a template writes after the closing tag belong to neither side.
                self.pending = self.pending.lstrip("\n")
                if not self.pending:
                    break
                self.state = "answer"
                continue
            if self.state == "answer":
                out.append(("content", self.pending))
                self.pending = ""
                break
            at = self.pending.find(THINK_CLOSE)
            if at >= 0:
                if at:
                    out.append(("reasoning", self.pending[:at]))
                self.pending, self.state = self.pending[at + len(THINK_CLOSE):], "after"
                continue
            hold = partial_end(self.pending, THINK_CLOSE)
            if len(self.pending) > hold:
                out.append(("reasoning", self.pending[: len(self.pending) - hold]))
                self.pending = self.pending[len(self.pending) - hold:]
            break
        return self._kept(out)

    def _kept(self, out: list[tuple[str, str]]) -> list[tuple[str, str]]:
        for kind, text in out:
            (self.reasoning if kind == "reasoning" else self.content).append(text)
        return out

    def flush(self) -> list[tuple[str, str]]:
        """What is still held: an unclosed block's end is thinking (the reply ran out inside it)."""
        text, self.pending = self.pending, ""
        if not text:
            return []
        return self._kept([("reasoning" if self.state == "thinking" else "content", text)])


def partial_end(text: str, tag: str) -> int:
    """The longest end of `text` that begins `tag` (and is shorter than it): what to hold back while streaming."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
