"""Cross-request prefix cache: ``CacheSnapshot``s in a radix tree keyed by the tokens they cover, budgeted in bytes.

A request resumes from the longest stored snapshot whose tokens are a prefix of its prompt (``lookup``). Edges of
the tree are token runs (a node per branch point or entry, not per token). Entries get integer ids from a counter in
insertion order, so ranks that insert the same sequences agree on them; a rank without a budget never evicts by
itself and drops what rank 0 evicted (``remove``).

Eviction frees the least recently used entries first, "system" entries (system prompt + tool declarations, shared
by conversations) only after every other kind.

Bytes are counted once per holder (``CacheSnapshot.holders``): the snapshots of one conversation share their full
latent pages (the same ``LatentPage`` objects), so a page held by several entries counts once, and removing an entry
frees only what no other entry holds.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

from ..cache import CacheSnapshot

KINDS = ("system", "message", "interval", "reply")


class MissingEntryError(ValueError):
    """An entry id that is not stored (never inserted, evicted or removed)."""


@dataclass
class Entry:
    """A stored snapshot of the first ``length`` tokens of a sequence; ``last_used`` orders eviction."""

    id: int
    length: int
    snapshot: CacheSnapshot
    kind: str
    last_used: int


class _Node:
    """A tree node: ``edge`` is the token run from its parent; ``children`` are keyed by their edge's first token."""

    __slots__ = ("edge", "parent", "children", "entry")

    def __init__(self, edge: tuple[int, ...], parent: Optional[_Node]):
        self.edge = edge
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.entry: Optional[Entry] = None


class PrefixCache:
    """Radix tree of snapshots. budget_bytes: the most bytes kept, shared pages counted once (None: no limit, never
    evicts); ``nbytes``: the bytes held now."""

    def __init__(self, budget_bytes: Optional[int]):
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0 or None, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.nbytes = 0
        self.hits = self.misses = self.tokens_reused = 0
        self._root = _Node((), None)
        self._nodes: dict[int, _Node] = {}  # entry id -> its node
        self._ids = itertools.count()
        self._clock = itertools.count(1)
        self._held: dict[int, list] = {}  # id(holder) -> [holder, number of entries holding it]

    def __len__(self) -> int:
        return len(self._nodes)

    def insert(self, tokens: Sequence[int], snap: CacheSnapshot, kind: str) -> tuple[int, list[int]]:
        """Store ``snap`` for exactly ``tokens``; returns (its id, ids evicted to fit the budget).

        An entry already stored for the same tokens is refreshed in place (same id, the new snapshot, marked used;
        it stays "system" if either kind is). A snapshot larger than the whole budget is not stored: it still gets
        an id (ranks count alike), and that id is in the evicted list.
        """
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        tokens = tuple(tokens)
        if not tokens or len(tokens) != snap.offset:
            raise ValueError(f"{len(tokens)} tokens for a snapshot at offset {snap.offset}: need the same, >= 1")
        node = self._find(tokens)
        old = node.entry if node is not None else None
        if self.budget_bytes is not None and snap.nbytes > self.budget_bytes:
            if old is None:
                id = next(self._ids)
                return id, [id]
            self.remove([old.id])
            return old.id, [old.id]
        if node is None:
            node = self._node_for(tokens)
        if old is None:
            entry = Entry(next(self._ids), len(tokens), snap, kind, next(self._clock))
        else:
            kind = "system" if "system" in (old.kind, kind) else kind
            entry = Entry(old.id, len(tokens), snap, kind, next(self._clock))
        self._hold(snap)
        if old is not None:
            self._release(old.snapshot)
        node.entry = entry
        self._nodes[entry.id] = node
        return entry.id, self._evict(keep=entry.id)

    def lookup(self, tokens: Sequence[int], limit: int) -> Optional[Entry]:
        """The longest entry whose tokens are a prefix of ``tokens``, at most ``limit`` long; marks it used."""
        best = None
        for depth, node in self._path(tuple(tokens)):
            if depth > limit:
                break
            best = node.entry or best
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        self.tokens_reused += best.length
        best.last_used = next(self._clock)
        return best

    def get(self, id: int) -> Entry:
        """The entry ``id`` (does not mark it used)."""
        node = self._nodes.get(id)
        if node is None:
            raise MissingEntryError(f"prefix cache entry {id} is not stored (never inserted, evicted or removed)")
        return node.entry

    def remove(self, ids: Sequence[int]) -> None:
        """Drop these entries; ids not stored are ignored (removing twice is harmless)."""
        for id in ids:
            node = self._nodes.pop(id, None)
            if node is not None:
                self._release(node.entry.snapshot)
                node.entry = None
                self._prune(node)

    def stats(self) -> dict:
        return {
            "entries": len(self),
            "bytes": self.nbytes,
            "budget_bytes": self.budget_bytes,
            "hits": self.hits,
            "misses": self.misses,
            "tokens_reused": self.tokens_reused,
        }

    def _hold(self, snap: CacheSnapshot) -> None:
        for h in snap.holders():
            held = self._held.setdefault(id(h), [h, 0])
            if held[1] == 0:
                self.nbytes += h.nbytes
            held[1] += 1

    def _release(self, snap: CacheSnapshot) -> None:
        for h in snap.holders():
            held = self._held[id(h)]
            held[1] -= 1
            if held[1] == 0:
                del self._held[id(h)]
                self.nbytes -= h.nbytes

    def _evict(self, keep: int) -> list[int]:
        """Remove entries other than ``keep`` until the budget holds: other kinds by least recent use, then
        "system" ones."""
        evicted = []
        while self.budget_bytes is not None and self.nbytes > self.budget_bytes:
            victim = min(
                (n.entry for i, n in self._nodes.items() if i != keep),
                key=lambda e: (e.kind == "system", e.last_used),
            )
            self.remove([victim.id])
            evicted.append(victim.id)
        return evicted

    def _path(self, tokens: tuple[int, ...]) -> Iterator[tuple[int, _Node]]:
        """(depth, node) for each node whose whole path from the root is a prefix of ``tokens``, root excluded."""
        node, i = self._root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None or tokens[i : i + len(child.edge)] != child.edge:
                return
            node, i = child, i + len(child.edge)
            yield i, node

    def _find(self, tokens: tuple[int, ...]) -> Optional[_Node]:
        """The node at exactly ``tokens``, if the tree has one."""
        for depth, node in self._path(tokens):
            if depth == len(tokens):
                return node
        return None

    def _node_for(self, tokens: tuple[int, ...]) -> _Node:
        """The node at exactly ``tokens``, creating it (and splitting an edge) as needed."""
        node, i = self._root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                child = node.children[tokens[i]] = _Node(tokens[i:], node)
                return child
            k = _common_length(child.edge, tokens[i:])
            if k < len(child.edge):  # split the edge at k: node -> mid -> child
                mid = node.children[tokens[i]] = _Node(child.edge[:k], node)
                child.edge, child.parent = child.edge[k:], mid
                mid.children[child.edge[0]] = child
                child = mid
            node, i = child, i + k
        return node

    def _prune(self, node: _Node) -> None:
        """Drop entry-less leaves up from ``node``, then fold an entry-less node with one child into that child."""
        while node is not self._root and node.entry is None and not node.children:
            del node.parent.children[node.edge[0]]
            node = node.parent
        if node is not self._root and node.entry is None and len(node.children) == 1:
            (child,) = node.children.values()
            child.edge, child.parent = node.edge + child.edge, node.parent
            node.parent.children[child.edge[0]] = child


def _common_length(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
