"""A chat as text to hand out: Markdown for people (the branch shown), JSON for scripts (that branch, every
branch as a tree, and each turn's statistics)."""
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
            model: str | None = None, tree: list[dict] | None = None) -> str:
    """`messages`: the branch shown. `tree`: every message as {"id", "parent" (an earlier id, or None),
    "role", "content", "shown"}; without it, the branch shown is the whole tree."""
    messages = list(messages)
    if tree is None:
        tree = [{"id": i, "parent": i - 1 if i else None, "role": role, "content": content, "shown": True}
                for i, (role, content) in enumerate(messages)]
    doc = {
        "title": title,
        "model": model,
        "messages": [{"role": role, "content": content} for role, content in messages],
        "turns": [{k: v for k, v in asdict(t).items() if k not in ("id", "message_id")} for t in turns],
        "tree": tree,
    }
    return json.dumps(doc, ensure_ascii=False, indent=1)
