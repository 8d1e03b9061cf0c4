"""A chat as text to hand out: Markdown for people (the branch shown), JSON for scripts (that branch, every
branch as a tree, and each turn's statistics)."""
from __future__ import annotations

import json
from dataclasses import asdict
from typing import Iterable

from .store import TurnRow

ROLE_NAMES = {"user": "You", "assistant": "Eddy", "system": "System", "tool": "Tool"}


def to_markdown(title: str, messages: Iterable[tuple]) -> str:
    """`messages`: (role, content[, extra]) each; a reply's thinking becomes a <details> block (folded, as the
    window shows it), its tool calls and a tool's result say what ran."""
    parts = [f"# {title}\n"]
    for role, content, *more in messages:
        extra = more[0] if more else {}
        if role == "tool":
            parts.append(f"**Tool `{extra.get('tool', '?')}`** ({extra.get('state', 'done')}):\n\n```\n"
                         f"{content.strip()}\n```\n")
            continue
        text = content.strip()
        if extra.get("reasoning"):
            seconds = extra.get("thinking_ms", 0) / 1e3
            text = (f"<details><summary>Thinking ({seconds:.1f} s)</summary>\n\n{extra['reasoning'].strip()}\n\n"
                    f"</details>\n\n{text}")
        for call in extra.get("tool_calls") or []:
            fn = call.get("function", {})
            text += f"\n\nCalls `{fn.get('name')}` with `{fn.get('arguments')}`"
        parts.append(f"**{ROLE_NAMES.get(role, role)}:**\n\n{text.strip()}\n")
    return "\n".join(parts)


def to_json(title: str, messages: Iterable[tuple], turns: Iterable[TurnRow] = (),
            model: str | None = None, tree: list[dict] | None = None) -> str:
    """`messages`: the branch shown. `tree`: every message as {"id", "parent" (an earlier id, or None),
    "role", "content", "shown"}; without it, the branch shown is the whole tree."""
    messages = list(messages)
    if tree is None:
        tree = [{"id": i, "parent": i - 1 if i else None, "role": m[0], "content": m[1], **(m[2] if len(m) > 2 else {}),
                 "shown": True} for i, m in enumerate(messages)]
    doc = {
        "title": title,
        "model": model,
        "messages": [{"role": m[0], "content": m[1], **(m[2] if len(m) > 2 else {})} for m in messages],
        "turns": [{k: v for k, v in asdict(t).items() if k not in ("id", "message_id")} for t in turns],
        "tree": tree,
    }
    return json.dumps(doc, ensure_ascii=False, indent=1)
