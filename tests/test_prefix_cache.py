"""``PrefixCache``: the radix tree of cache snapshots (lookups, limits, edge splits and folds), refreshes, the byte
budget and its eviction order, and the insertion-ordered ids that keep ranks in agreement.

Snapshots here are stand-ins of a chosen size (float32 arrays as KDA states); the tree reads ``offset`` and what
holds memory (``holders``, counted once however many entries share one; real snapshots share latent pages:
tests/test_cache_pages.py).
"""

import mlx.core as mx
import pytest

from kimi_mlx.cache import CacheSnapshot
from kimi_mlx.server.prefix_cache import MissingEntryError, PrefixCache


def _snap(n: int, nbytes: int = 400) -> CacheSnapshot:
    return CacheSnapshot(n, (True,), ((mx.zeros(nbytes // 4), None),))


def _edges(cache: PrefixCache) -> dict:
    """The tree as nested {edge: children} (reads the private root: the shape is the point of a radix tree)."""

    def walk(node):
        return {child.edge: walk(child) for child in node.children.values()}

    return walk(cache._root)


def test_lookup_finds_the_longest_stored_prefix_within_the_limit():
    """Entries at [1 2 3 4], [1 2 3 4 5 6] and [1 2 7] share the edge (1, 2) (split on insert); a lookup returns the
    longest entry that prefixes the tokens and is at most ``limit`` long, and counts hits, misses, tokens reused."""
    cache = PrefixCache(None)
    a, _ = cache.insert([1, 2, 3, 4], _snap(4), "message")
    b, _ = cache.insert([1, 2, 3, 4, 5, 6], _snap(6), "reply")
    c, _ = cache.insert([1, 2, 7], _snap(3), "message")
    assert (a, b, c) == (0, 1, 2) and len(cache) == 3
    assert _edges(cache) == {(1, 2): {(3, 4): {(5, 6): {}}, (7,): {}}}

    assert cache.lookup([1, 2, 3, 4, 5, 6, 9], limit=100).id == b
    assert cache.lookup([1, 2, 3, 4, 5, 6], limit=5).id == a
    assert cache.lookup([1, 2, 3, 4, 5, 7], limit=100).id == a  # diverges inside the (5, 6) edge
    assert cache.lookup([1, 2, 3, 4], limit=4).id == a
    hit = cache.lookup([1, 2, 7, 8], limit=3)
    assert (hit.id, hit.length, hit.kind, hit.snapshot.offset) == (c, 3, "message", 3)
    for tokens, limit in (([1, 2, 3, 4], 3), ([1, 2], 10), ([1, 3], 10), ([9], 10), ([], 10)):
        assert cache.lookup(tokens, limit) is None
    assert cache.stats() == {"entries": 3, "bytes": 1200, "budget_bytes": None, "hits": 5, "misses": 5,
                             "tokens_reused": 6 + 4 + 4 + 4 + 3}


def test_remove_prunes_and_folds_the_tree():
    """Removing entries drops their empty leaves and folds an entry-less node with a single child into it; the
    remaining entries are still found; removing everything leaves an empty tree and 0 bytes."""
    cache = PrefixCache(None)
    a, _ = cache.insert([1, 2, 3, 4], _snap(4), "message")
    b, _ = cache.insert([1, 2, 3, 4, 5, 6], _snap(6), "reply")
    c, _ = cache.insert([1, 2, 7], _snap(3), "message")
    cache.remove([c])
    assert _edges(cache) == {(1, 2, 3, 4): {(5, 6): {}}}
    cache.remove([a])
    assert _edges(cache) == {(1, 2, 3, 4, 5, 6): {}}
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7], 10).id == b and cache.lookup([1, 2, 3, 4, 5], 10) is None
    cache.remove([b, b, 99])  # unknown and repeated ids are ignored
    assert _edges(cache) == {} and len(cache) == 0 and cache.nbytes == 0
    with pytest.raises(MissingEntryError, match="entry 1 is not stored"):
        cache.get(b)
    # the tree builds again where it was pruned
    d, _ = cache.insert([1, 2], _snap(2), "message")
    assert d == 3 and cache.get(d).length == 2 and _edges(cache) == {(1, 2): {}}


def test_refresh_of_an_existing_key():
    """Inserting the same tokens again keeps the entry's id, stores the new snapshot (bytes follow), marks it used,
    and keeps the kind "system" if either insert said so."""
    cache = PrefixCache(10_000)
    first, _ = cache.insert([5, 6, 7], _snap(3, 400), "system")
    other, _ = cache.insert([5, 6], _snap(2, 400), "message")
    new = _snap(3, 800)
    again, evicted = cache.insert([5, 6, 7], new, "message")
    assert again == first and evicted == [] and len(cache) == 2 and cache.nbytes == 1200
    entry = cache.get(first)
    assert entry.snapshot is new and entry.kind == "system" and entry.last_used > cache.get(other).last_used
    cache.insert([5, 6], _snap(2, 400), "reply")
    assert cache.get(other).kind == "reply"
    assert cache.insert([9], _snap(1), "message")[0] == 2  # refreshes took no id


def test_budget_evicts_least_recently_used_with_system_last():
    """Over budget, the least recently used non-system entries go first, "system" ones only after them; the entry
    being inserted is never the one evicted for it."""
    cache = PrefixCache(1000)
    s, _ = cache.insert([1], _snap(1, 300), "system")
    a, _ = cache.insert([2], _snap(1, 300), "message")
    b, _ = cache.insert([3], _snap(1, 300), "interval")
    cache.lookup([2, 9], limit=1)  # a is now used more recently than b
    c, evicted = cache.insert([4], _snap(1, 300), "reply")
    assert evicted == [b] and cache.nbytes == 900
    d, evicted = cache.insert([5], _snap(1, 300), "message")
    assert evicted == [a]
    e, evicted = cache.insert([6], _snap(1, 700), "message")
    assert evicted == [c, d] and cache.nbytes == 1000
    g, evicted = cache.insert([7], _snap(1, 800), "system")
    assert evicted == [e, s] and len(cache) == 1 and cache.get(g).kind == "system"
    m, evicted = cache.insert([8], _snap(1, 300), "message")
    assert evicted == [g] and [cache.get(m).id] == [m]  # all others are system: still not the new entry


def test_oversize_snapshot_is_not_stored():
    """A snapshot over the whole budget is not stored: it gets an id (ranks keep counting alike) that is returned
    as evicted; refreshing an existing entry with one drops that entry."""
    cache = PrefixCache(1000)
    a, _ = cache.insert([1, 2], _snap(2, 400), "system")
    big, evicted = cache.insert([1, 2, 3], _snap(3, 1200), "message")
    assert (big, evicted) == (1, [1]) and len(cache) == 1 and cache.nbytes == 400
    assert cache.lookup([1, 2, 3, 4], 10).id == a
    again, evicted = cache.insert([1, 2], _snap(2, 1004), "system")
    assert (again, evicted) == (a, [a]) and len(cache) == 0 and cache.nbytes == 0
    assert cache.insert([1], _snap(1, 1000), "message") == (2, [])  # exactly the budget fits


def test_shared_holders_count_once():
    """Two entries whose snapshots hold the same 400-byte array (as one conversation's snapshots hold the same
    latent pages) count it once; removing one entry frees only its own array; a budget short of both evicts the
    least recently used entry, which frees its own 100 bytes only; refreshing an entry with a snapshot that keeps the
    shared array frees only what the old snapshot alone held."""
    shared = mx.zeros(100)
    a = CacheSnapshot(2, (True, True), ((shared, None), (mx.zeros(25), None)))
    b = CacheSnapshot(3, (True, True), ((shared, None), (mx.zeros(50), None)))
    cache = PrefixCache(None)
    ia, _ = cache.insert([1, 2], a, "message")
    ib, _ = cache.insert([1, 2, 3], b, "message")
    assert (a.nbytes, b.nbytes, cache.nbytes) == (500, 600, 700)
    cache.remove([ia])
    assert cache.nbytes == 600
    cache.remove([ib])
    assert cache.nbytes == 0

    budget = PrefixCache(650)
    ia, _ = budget.insert([1, 2], a, "message")
    ib, evicted = budget.insert([1, 2, 3], b, "message")
    assert evicted == [ia] and budget.nbytes == 600
    again, evicted = budget.insert([1, 2, 3], CacheSnapshot(3, (True,), ((shared, None),)), "message")
    assert (again, evicted, budget.nbytes) == (ib, [], 400)


def test_ids_agree_across_ranks():
    """Rank 0 (a budget) and another rank (no budget: never evicts by itself) insert the same sequences and get the
    same ids; the other rank drops what rank 0 evicted and both hold the same entries."""
    rank0, rank1 = PrefixCache(1000), PrefixCache(None)
    for i in range(6):
        tokens, snap = list(range(i + 1)), _snap(i + 1, 300)
        id0, evicted = rank0.insert(tokens, snap, "message")
        id1, none = rank1.insert(tokens, snap, "message")
        assert id0 == id1 == i and none == []
        rank1.remove(evicted)
    assert len(rank0) == len(rank1) == 3
    assert [rank1.get(i).length for i in (3, 4, 5)] == [rank0.get(i).length for i in (3, 4, 5)] == [4, 5, 6]
    assert rank1.nbytes == rank0.nbytes == 900


def test_bad_arguments_are_refused():
    cache = PrefixCache(100)
    with pytest.raises(ValueError, match="kind must be one of"):
        cache.insert([1], _snap(1), "other")
    with pytest.raises(ValueError, match="2 tokens for a snapshot at offset 3"):
        cache.insert([1, 2], _snap(3), "message")
    with pytest.raises(ValueError, match="0 tokens"):
        cache.insert([], _snap(0), "message")
    with pytest.raises(ValueError, match="budget_bytes must be >= 0"):
        PrefixCache(-1)
