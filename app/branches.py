"""A chat as a tree: each message has a parent (None for a first message) and may have alternatives, its
siblings (replies written again, user messages edited). The branch shown goes from a root down, taking at each
level the child chosen most recently.

"Most recently chosen" is a rank per message rather than a pointer per parent: a branch left and later shown
again comes back as it was left, its own choices further down kept, and the store keeps it as one integer
column. Qt-free, so the store uses it too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Generic, Iterable, Iterator, TypeVar

T = TypeVar("T")
R = TypeVar("R")


@dataclass(eq=False)  # identity: two equal messages in two branches are two nodes
class Node(Generic[T]):
    item: T
    parent: "Node[T] | None" = None
    children: list["Node[T]"] = field(default_factory=list)
    rank: int = 0  # when it was last chosen: among its siblings the highest is shown


class ChatTree(Generic[T]):
    def __init__(self) -> None:
        self.roots: list[Node[T]] = []
        self.clock = 0  # the highest rank given so far

    @classmethod
    def of(cls, rows: Iterable[R], key: Callable[[R], object], parent: Callable[[R], object],
           rank: Callable[[R], int], item: Callable[[R], T]) -> "ChatTree[T]":
        """A tree from stored rows, siblings in the rows' order. Rows may come in any order (a parent stored after
        its child still gets it); a row whose parent is missing becomes a root rather than being lost."""
        tree: ChatTree[T] = cls()
        rows = list(rows)
        nodes = {key(row): Node(item(row), None, [], rank(row)) for row in rows}
        for row in rows:
            node = nodes[key(row)]
            node.parent = nodes.get(parent(row))
            tree.siblings(node).append(node)
            tree.clock = max(tree.clock, node.rank)
        return tree

    def siblings(self, node: Node[T]) -> list[Node[T]]:
        """The node's alternatives, itself among them, oldest first."""
        return node.parent.children if node.parent is not None else self.roots

    def add(self, parent: Node[T] | None, item: T, rank: int | None = None) -> Node[T]:
        """A new child of `parent` (None: a root), shown unless `rank` (a stored one) says otherwise."""
        node = Node(item, parent, [], self._tick() if rank is None else rank)
        self.clock = max(self.clock, node.rank)
        (parent.children if parent is not None else self.roots).append(node)
        return node

    def choose(self, node: Node[T]) -> None:
        """Shows `node` in place of its siblings (and below it the branch last shown under it)."""
        if self._shown(self.siblings(node)) is not node:
            node.rank = self._tick()

    def show(self, node: Node[T]) -> list[Node[T]]:
        """Makes the branch shown go through `node`; returns the nodes whose rank changed."""
        changed = []
        up: Node[T] | None = node
        while up is not None:
            if self._shown(self.siblings(up)) is not up:
                up.rank = self._tick()
                changed.append(up)
            up = up.parent
        return changed

    def remove(self, node: Node[T]) -> None:
        """Takes `node` and everything under it out; the sibling chosen before it is shown again."""
        self.siblings(node).remove(node)

    def path(self) -> list[Node[T]]:
        """The branch shown, from a root to its last message."""
        out: list[Node[T]] = []
        level = self.roots
        while level:
            best = self._shown(level)
            out.append(best)
            level = best.children
        return out

    def alternatives(self, node: Node[T]) -> tuple[int, int]:
        """(which of its siblings `node` is, from 1; how many there are)."""
        siblings = self.siblings(node)
        return siblings.index(node) + 1, len(siblings)

    def nodes(self) -> Iterator[Node[T]]:
        """Every node, each after its parent."""
        stack = list(reversed(self.roots))
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children))

    def __len__(self) -> int:
        return sum(1 for _ in self.nodes())

    @staticmethod
    def _shown(level: list[Node[T]]) -> Node[T]:
        # Ties (a migrated chain has rank 0 everywhere) go to the newest.
        return max(reversed(level), key=lambda n: n.rank)

    def _tick(self) -> int:
        self.clock += 1
        return self.clock
