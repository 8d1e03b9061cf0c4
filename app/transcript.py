"""A chat as text to hand out: Markdown for people, JSON for scripts (with each turn's statistics)."""
from __future__ import annotations

import json
from dataclasses import asdict
from typing import Iterable

from .store import TurnRow

ROLE_NAMES = {"user": "You", "assistant": "Eddy", "system": "System"}


def to_markdown(title: str, messages: Iterable[tuple[str, str]]) -> str:
    parts = [f"# {title}\n"]
    for role, content in messages:
        parts.append(f"**{ROLE_NAMES.get(role, role)}:**\n\n{content.strip()}\n")
    return "\n".join(parts)


def to_json(title: str, messages: Iterable[tuple[str, str]], turns: Iterable[TurnRow] = (),
            model: str | None = None) -> str:
    doc = {
        "title": title,
        "model": model,
        "messages": [{"role": role, "content": content} for role, content in messages],
        "turns": [{k: v for k, v in asdict(t).items() if k not in ("id", "message_id")} for t in turns],
    }
    return json.dumps(doc, ensure_ascii=False, indent=1)
