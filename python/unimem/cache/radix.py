"""A page-granular radix tree of token ids: the structure under the prefix cache.

One node per page. A node's ``key`` is the ``page_size`` token ids of one page; the path from
the root to a node at ``depth`` d spells the prefix ``tokens[: d * page_size]``, and the node
covers page column ``d - 1``. The tree knows nothing of pools: it stores what the prefix cache
puts in each node (a page id and what the cache holds there) and answers structural queries.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

PageKey = tuple[int, ...]


@dataclass(eq=False)
class Node:
    """One cached page.

    ``page``: the virtual page id holding the K/V of this page's tokens (the cache holds its
    FULL unit). ``swa``: the cache also holds the page's SWA unit; ``window_refs``: how many
    windows cover this node — one per anchor at or below it within the window, plus one per
    admission in progress resuming there (the cache keeps ``swa`` exactly while it is > 0).
    ``anchor``: a resume point the cache keeps — the window behind its end is retained and, for
    models with STATE layers, ``checkpoint`` is a state slot holding the state after its last
    token (-1 otherwise). ``last_access``: logical time of the last match or insert through it
    (LRU). ``pins``: temporary protection from eviction while an admission uses the node.
    """

    key: PageKey
    page: int
    parent: Node | None
    depth: int
    children: dict[PageKey, Node] = field(default_factory=dict)
    swa: bool = False
    window_refs: int = 0
    anchor: bool = False
    checkpoint: int = -1
    last_access: int = 0
    pins: int = 0

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def window(self, pages: int) -> Iterator[Node]:
        """This node and its ancestors, ``pages`` nodes at most (the root excluded)."""
        node: Node | None = self
        for _ in range(pages):
            if node is None or node.parent is None:
                return
            yield node
            node = node.parent


class RadixTree:
    """Nodes keyed by pages of ``page_size`` token ids under an empty root."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.root = Node(key=(), page=-1, parent=None, depth=0)
        self.size = 0

    def key(self, tokens: Sequence[int], column: int) -> PageKey:
        """The key of page column ``column`` of ``tokens`` (which must cover it); ``ValueError``
        if a token id there is not an integer."""
        p = self.page_size
        try:
            return tuple(map(operator.index, tokens[column * p : (column + 1) * p]))
        except TypeError:
            bad = next(
                t for t in tokens[column * p : (column + 1) * p] if not hasattr(t, "__index__")
            )
            raise ValueError(
                f"tokens[{column * p}:{(column + 1) * p}]: token ids must be ints, got {bad!r}"
            ) from None

    def walk(self, tokens: Sequence[int]) -> list[Node]:
        """The longest path of existing nodes spelling a prefix of ``tokens`` (whole pages)."""
        path: list[Node] = []
        node = self.root
        for c in range(len(tokens) // self.page_size):
            child = node.children.get(self.key(tokens, c))
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def walk_keys(self, keys: Sequence[PageKey]) -> list[Node]:
        """The longest path of existing nodes whose keys are a prefix of ``keys``."""
        path: list[Node] = []
        node = self.root
        for key in keys:
            child = node.children.get(key)
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def add(self, parent: Node, key: PageKey, page: int) -> Node:
        """A new child of ``parent`` (which must not have one with ``key``)."""
        if key in parent.children:
            raise ValueError(f"node for key {key} already exists at depth {parent.depth + 1}")
        node = Node(key=key, page=page, parent=parent, depth=parent.depth + 1)
        parent.children[key] = node
        self.size += 1
        return node

    def remove_leaf(self, node: Node) -> None:
        if not node.is_leaf or node.parent is None:
            raise ValueError("only a leaf below the root can be removed")
        del node.parent.children[node.key]
        node.parent = None
        self.size -= 1

    def nodes(self) -> Iterator[Node]:
        """Every node but the root, children before their parent (safe to remove in order)."""
        stack: list[tuple[Node, bool]] = [(self.root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                if node.parent is not None:
                    yield node
                continue
            stack.append((node, True))
            stack.extend((c, False) for c in node.children.values())
