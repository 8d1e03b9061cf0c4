"""Rendering only the tail of a long chat: when a template may, and a record of the chats it was checked on.

Re-rendering the whole history every turn costs O(history). Most chat templates see the messages only through
one loop whose body depends on the message itself, loop.first/loop.last, the parity of loop.index0 and a few
messages at fixed places at the start (messages[0] for system handling). For such a template the rendering of
the last messages is the same whether the messages in the middle are there or not, so a short stand-in
(the first `head` messages and the last `tail` ones, an even number left out so the parity holds) renders the
same tail. `locality` proves that from the template's syntax tree, conservatively: anything it cannot follow
(messages|length, negative indices, loop.index printed, namespace state carried across turns, break, range
in the loop, a second loop over the messages) means "render in full".

What the syntax cannot tell is whether the left-out messages would still render without error (a template may
raise_exception on a bad role order): that is why only messages of a known conversation are left out, ones
already rendered without error in a place where their rendering no longer changes (`Conversation.settled`).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from jinja2 import nodes

# Messages kept at the end of a stand-in; at least 3 so that every left-out message was rendered, while in the
# tail, as neither the first nor the last one with and without the generation prompt (see Tokenizer.chat_delta).
MIN_TAIL = 3
_LOOP_ATTRS = frozenset({"first", "last", "index0", "index"})
# Blocks that may run their body more than once or somewhere else than where they stand.
_REPEATING = (nodes.For, nodes.Macro, nodes.CallBlock, nodes.FilterBlock)


@dataclass(frozen=True)
class Locality:
    head: int  # messages a stand-in keeps from the start
    tail: int  # ... and from the end


def _parents(root: nodes.Node) -> dict[int, nodes.Node]:
    out: dict[int, nodes.Node] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        for child in node.iter_child_nodes():
            out[id(child)] = node
            stack.append(child)
    return out


def _const_int(node: nodes.Node | None) -> int | None:
    if isinstance(node, nodes.Const) and type(node.value) is int:
        return node.value
    return None


def _plain_slice(node: nodes.Node) -> int | None:
    """Start of a `[c:]` slice (c >= 0 or absent), else None."""
    if not isinstance(node, nodes.Slice) or node.stop is not None or node.step is not None:
        return None
    start = 0 if node.start is None else _const_int(node.start)
    return start if start is not None and start >= 0 else None


class _Check:
    """One pass over a template's syntax tree; `result` is None if a stand-in may render differently."""

    def __init__(self, root: nodes.Template) -> None:
        self.root, self.parent = root, _parents(root)
        self.biggest = 0  # largest constant a message index is taken or compared against
        self.shift = 0  # largest start of a slice of the messages (a loop over messages[1:] counts from there)
        self.loops: list[nodes.For] = []
        self.aliases = self._aliases()

    def _is_list(self, node: nodes.Node, aliases: set[str]) -> bool:
        # `messages`, a name set from it, a `[c:]` slice of either, or `a if test else b` of two such.
        if isinstance(node, nodes.Name):
            return node.name in aliases
        if isinstance(node, nodes.CondExpr):
            return (node.expr2 is not None and self._is_list(node.expr1, aliases)
                    and self._is_list(node.expr2, aliases))
        return (isinstance(node, nodes.Getitem) and _plain_slice(node.arg) is not None
                and self._is_list(node.node, aliases))

    def _aliases(self) -> set[str]:
        aliases = {"messages"}
        while True:
            more = {a.target.name for a in self.root.find_all(nodes.Assign)
                    if isinstance(a.target, nodes.Name) and self._is_list(a.node, aliases)} - aliases
            if not more:
                return aliases
            aliases |= more

    def _list_use_ok(self, node: nodes.Node) -> bool:
        # Follow slices up to what is done with the list: loop over it, name it, or take one message by a
        # constant index from the start.
        up = self.parent.get(id(node))
        while (isinstance(up, nodes.Getitem) and up.node is node and _plain_slice(up.arg) is not None
               or isinstance(up, nodes.CondExpr) and up.test is not node and self._is_list(up, self.aliases)):
            if isinstance(up, nodes.Getitem):
                self.shift = max(self.shift, _plain_slice(up.arg) or 0)
            node, up = up, self.parent.get(id(up))
        if isinstance(up, nodes.For) and up.iter is node:
            self.loops.append(up)
            return True
        if isinstance(up, nodes.Assign) and up.node is node and isinstance(up.target, nodes.Name):
            return True
        if isinstance(up, nodes.Getitem) and up.node is node:
            index = _const_int(up.arg)
            if index is not None and index >= 0:
                self.biggest = max(self.biggest, index)
                return True
        return False

    def _inside_repeating(self, node: nodes.Node) -> bool:
        up = self.parent.get(id(node))
        while up is not None:
            if isinstance(up, _REPEATING):
                return True
            up = self.parent.get(id(up))
        return False

    def _loop_body(self, loop: nodes.For) -> list[nodes.Node]:
        # Every node the messages loop runs per message, minus the bodies of loops nested in it (their own `loop`).
        out, stack = [], list(loop.body)
        while stack:
            node = stack.pop()
            out.append(node)
            if isinstance(node, nodes.For):
                stack += [node.target, node.iter]
            else:
                stack += list(node.iter_child_nodes())
        return out

    def _loop_var_ok(self, name: nodes.Name) -> bool:
        attr = self.parent.get(id(name))
        if not isinstance(attr, nodes.Getattr) or attr.attr not in _LOOP_ATTRS:
            return False  # loop.length, loop.revindex, loop.cycle, loop.previtem, loop passed on, ...
        if attr.attr in ("first", "last"):
            return True
        up = self.parent.get(id(attr))
        if isinstance(up, nodes.Mod) and up.left is attr and _const_int(up.right) == 2:
            return True  # role alternation checks: the stand-in leaves out an even number of messages
        if isinstance(up, nodes.Operand):  # loop.index0 on the right of a comparison
            up, other = self.parent.get(id(up)), up
            other = up.expr if isinstance(up, nodes.Compare) and up.ops[0] is other else None
        elif isinstance(up, nodes.Compare) and up.expr is attr:
            other = up.ops[0].expr
        else:
            other = None
        if isinstance(up, nodes.Compare) and len(up.ops) == 1 and _const_int(other) is not None:
            self.biggest = max(self.biggest, abs(_const_int(other) or 0))
            return True  # loop.index0 == 0: the stand-in keeps the first messages where they were
        return False

    def _loop_ok(self, loop: nodes.For) -> bool:
        if loop.test is not None or loop.recursive or self._inside_repeating(loop):
            return False
        for node in self._loop_body(loop):
            if isinstance(node, nodes.Break):
                return False  # a message left out could have ended the loop
            if isinstance(node, (nodes.Assign, nodes.AssignBlock)) and isinstance(node.target, nodes.NSRef):
                return False  # state carried from one message to the next
            if isinstance(node, nodes.Call) and isinstance(node.node, nodes.Name) and node.node.name == "range":
                return False  # the work budget is per render: the full one could run out where a stand-in does not
            if isinstance(node, nodes.Name) and node.name == "loop" and not self._loop_var_ok(node):
                return False
        return True

    def result(self) -> Locality | None:
        for name in self.root.find_all(nodes.Name):
            if name.name not in self.aliases:
                continue
            if name.ctx != "load":
                if not isinstance(self.parent.get(id(name)), nodes.Assign):
                    return None  # e.g. `for messages in ...`: the name no longer means the chat
                continue
            if not self._list_use_ok(name):
                return None
        if len(self.loops) != 1 or not self._loop_ok(self.loops[0]):
            return None
        return Locality(head=self.biggest + self.shift + 2, tail=MIN_TAIL)


def locality(root: nodes.Template) -> Locality | None:
    """How a stand-in for a long chat must look for this template, or None if none renders like the chat."""
    return _Check(root).result()


# --- conversations a stand-in may be used for --------------------------------------------------------------

@dataclass
class Conversation:
    # The messages themselves, not copies: comparing a history with them costs a pointer check per message
    # (list equality tries identity first), and only falls back to comparing contents for other dicts.
    messages: list[dict]
    settled: int  # messages[:settled] rendered without error where their rendering no longer changes
    # marks[k]: the sentinel candidates used by messages[:k] (a render must pick sentinels none of them uses)
    marks: list[frozenset[str]] = field(default_factory=lambda: [frozenset()])


class Conversations:
    """The last few chats rendered, so a later turn of one may render its tail only.

    A chat is told by its messages: the same dicts, or dicts of the same content. A settled message changed in
    place (ChatSession never does: it appends, and reset() takes a new list) goes unnoticed; that could only hide
    an error the full render would raise, never change the tail's tokens (see Tokenizer._tail_read).
    """

    _KEEP = 4

    def __init__(self, candidates: frozenset[str]) -> None:
        self._candidates = candidates
        self._lock = threading.Lock()
        self._chats: list[Conversation] = []

    def known(self, history: list[dict]) -> tuple[int, frozenset[str]]:
        """(n, marks): history[:n] is settled in a known chat, and marks[...] the sentinel candidates it uses."""
        with self._lock:
            best = (0, frozenset[str]())
            for chat in self._chats:
                n = min(len(history), chat.settled)
                if n > best[0] and history[:n] == chat.messages[:n]:
                    best = (n, chat.marks[n])
            return best

    def record(self, messages: list[dict], settled: int) -> None:
        """messages[:settled] were rendered without error where their rendering no longer changes."""
        with self._lock:
            chat = self._match(messages)
            if chat is None:
                chat = Conversation([], 0)
                self._chats = [chat, *self._chats][: self._KEEP]
            else:
                self._chats.remove(chat)
                self._chats.insert(0, chat)
            same = self._common(chat.messages, messages)
            del chat.messages[same:], chat.marks[same + 1:]
            for m in messages[same:]:
                chat.messages.append(m)
                used = {c for v in m.values() if isinstance(v, str) for c in self._candidates if c in v}
                chat.marks.append(chat.marks[-1] | used if used else chat.marks[-1])
            chat.settled = max(min(chat.settled, same), settled)

    def _match(self, messages: list[dict]) -> Conversation | None:
        return next((c for c in self._chats if c.messages[:1] == messages[:1]), None)

    @staticmethod
    def _common(a: list[dict], b: list[dict]) -> int:
        n = min(len(a), len(b))
        if a[:n] == b[:n]:
            return n
        return next(i for i in range(n) if a[i] != b[i])
