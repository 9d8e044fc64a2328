"""The paged MLA latent cache (``kimi_mlx.cache``): what shares pages and what copies, on the tiny Kimi Linear
reference (float32) with small pages so that short sequences span several.

Sharing is checked by identity (a shared page is the same ``LatentPage`` object, so the same buffer) and by the
bytes the prefix cache counts, against ``parallel.accounting.cache_bytes`` (the layout formula, itself tested equal to
real caches): a chain of snapshots of one conversation holds each full page once, plus each snapshot's own copy of
its partial last page and its KDA state. Values are checked against a cold cache fed the same tokens.
"""

import mlx.core as mx
import numpy as np
import pytest

from kimi_mlx.cache import LatentPage, MLALatentCache, cache_from_snapshot, make_cache, merge_caches
from kimi_mlx.parallel.accounting import cache_bytes
from kimi_mlx.server.prefix_cache import PrefixCache
from kimi_mlx.server.scheduler import GenerationRequest, Scheduler

P = 16  # positions per page in these tests
TOL = 1e-5


@pytest.fixture(autouse=True)
def small_pages(monkeypatch):
    monkeypatch.setattr(MLALatentCache, "page_size", P)


def _tokens(model, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, model.args.vocab_size, n).tolist()


def _feed(model, cache, tokens: list[list[int]]) -> mx.array:
    logits = model(mx.array(tokens), cache=cache)[:, -1]
    mx.eval(logits, [c.state for c in cache])
    return logits


def _latent(cache) -> list[MLALatentCache]:
    return [c for c in cache if isinstance(c, MLALatentCache)]


def _mla_states(snap) -> list:
    """The snapshot's MLA layers' page tuples."""
    return [s for s, kda in zip(snap.states, snap.kda_layers) if not kda]


def _values(snap) -> list[np.ndarray]:
    """Copies of the values of every latent page of ``snap``."""
    return [np.array(a) for pages in _mla_states(snap) for p in pages for a in p.arrays]


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def _mla_bytes(cfg, n: int) -> int:
    """Latent bytes of n positions over every MLA layer (float32)."""
    mla = [i for i in range(cfg.num_hidden_layers) if not cfg.is_kda_layer(i)]
    return cache_bytes(cfg, n, mla, act_bytes=4)


def _chain_bytes(cfg, lengths: list[int]) -> int:
    """Bytes of snapshots at ``lengths`` tokens of one sequence when full pages are held once: the full pages of
    the longest, each snapshot's partial last page and KDA state."""
    kda = [i for i in range(cfg.num_hidden_layers) if cfg.is_kda_layer(i)]
    own = sum(_mla_bytes(cfg, n % P) + cache_bytes(cfg, 0, kda, act_bytes=4) for n in lengths)
    return own + _mla_bytes(cfg, max(lengths) // P * P)


def test_snapshot_shares_full_pages_and_copies_the_partial_one(kl_model):
    """After 40 tokens (pages of 16, 16, 8): the snapshot's first two pages are the cache's, its third an 8-position
    copy. The cache goes on, then is restored to a checkpoint at 20 tokens, inside the shared page 1, and written:
    that page is copied (copy on write), the snapshot keeps its values, and both the cache and a cache restored from
    the snapshot continue like cold caches fed the same tokens."""
    model = kl_model
    prompt, more, other = _tokens(model, 40, 0), _tokens(model, 10, 1), _tokens(model, 5, 2)
    cache = model.make_cache()
    _feed(model, cache, [prompt[:20]])
    cp = cache.checkpoint()
    _feed(model, cache, [prompt[20:]])
    snap = cache.snapshot()
    for c, pages in zip(_latent(cache), _mla_states(snap)):
        assert [p.size for p in pages] == [16, 16, 8] and all(isinstance(p, LatentPage) for p in pages)
        assert pages[0] is c.pages[0] and pages[1] is c.pages[1] and pages[2] is not c.pages[2]
    kept = _values(snap)

    _feed(model, cache, [more])
    assert all(c.pages[1] is pages[1] for c, pages in zip(_latent(cache), _mla_states(snap)))
    cache.restore(cp)
    shared = [c.pages[1] for c in _latent(cache)]
    after_restore = _feed(model, cache, [other])
    assert all(c.pages[1] is not page for c, page in zip(_latent(cache), shared))
    assert _same(kept, _values(snap))
    cold = model.make_cache()
    _feed(model, cold, [prompt[:20]])
    assert mx.abs(after_restore - _feed(model, cold, [other])).max().item() <= TOL

    restored, cold = cache_from_snapshot(snap), model.make_cache()
    for c, pages in zip(_latent(restored), _mla_states(snap)):
        assert all(a is b for a, b in zip(c.pages, pages))
    _feed(model, cold, [prompt])
    assert mx.abs(_feed(model, restored, [other]) - _feed(model, cold, [other])).max().item() <= TOL
    for c in _latent(restored):  # the short page became a full page at the first write; the snapshot's is intact
        assert [p.size for p in c.pages] == [16, 16, 16]
    assert _same(kept, _values(snap))


def test_what_each_operation_allocates():
    """Bytes allocated, on a one-layer latent cache (r = 128, dr = 32, float32) with 256-position pages after 300
    positions: a snapshot allocates exactly the copy of the 44-position partial page; the next write goes into the
    cache's last page in place (no page copied); a write into a page the snapshot shares (after a trim) copies that
    page once; growth past a page end allocates one page and copies nothing."""
    cache = make_cache([False])
    c = cache[0]
    c.page_size = 256
    per_position = (128 + 32) * 4

    def write(n):
        mx.eval(c.update_and_fetch(mx.ones((1, 1, n, 128)), mx.ones((1, 1, n, 32))))

    def cost(fn) -> tuple[int, int, object]:
        """(bytes still allocated after fn, peak bytes during it, its result)."""
        mx.clear_cache()  # no reuse of a larger free buffer (counted whole)
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        out = fn()
        return mx.get_active_memory() - before, mx.get_peak_memory() - before, out

    write(300)
    held, _, snap = cost(cache.snapshot)  # kept alive below: it shares page 0
    assert held == 44 * per_position
    page = 256 * per_position
    _, peak, _ = cost(lambda: write(1))
    assert peak < page // 4  # in place: no page copied
    c.trim(100)  # 201 positions: the next write lands in page 0, which the snapshot shares
    held, peak, _ = cost(lambda: write(1))
    assert held == page and peak < page + page // 4  # page 0 copied once (the snapshot keeps the old one)
    write(55)  # 257 positions: a second page
    held, peak, _ = cost(lambda: write(256))  # fills page 1 and starts page 2
    assert held == page and peak < 2 * page + page // 4  # one new page (+ the 256 positions written): no copy


def test_last_page_room_doubles(monkeypatch):
    """A one-layer latent cache with 1024-position pages (r = 8, dr = 4): a last page has room for the next power of
    two of what it holds, at least 256 (``MIN_ROOM``), at most a page: 300 positions take a 512-room page, 600 a
    1024 one, 1100 a full page and a 256-room one; a 2-row batch merged from two 300-position caches and a cache
    restored from a 300-position snapshot keep short pages and grow them the same way, never to a whole page at
    their next write. Every position keeps its value."""
    monkeypatch.setattr(MLALatentCache, "page_size", 1024)
    cache = make_cache([False])
    data = mx.arange(1100 * 12, dtype=mx.float32).reshape(1, 1, 1100, 12)

    def write(cache, a, b, rows=1):
        x = mx.broadcast_to(data[:, :, a:b], (rows, 1, b - a, 12))
        mx.eval(cache[0].update_and_fetch(x[..., :8], x[..., 8:]))

    def rooms(cache):
        return [p.size for p in cache[0].pages]

    def values(cache):
        kv, pe = (mx.concatenate(parts, axis=2) for parts in cache[0].fetch())
        return np.array(mx.concatenate([kv, pe], axis=-1))

    write(cache, 0, 300)
    assert rooms(cache) == [512]
    snap, other = cache.snapshot(), make_cache([False])
    write(other, 0, 300)
    write(cache, 300, 600)
    assert rooms(cache) == [1024]
    write(cache, 600, 1100)
    assert rooms(cache) == [1024, 256]
    assert np.array_equal(values(cache), np.array(data))
    restored = cache_from_snapshot(snap)
    assert rooms(restored) == [300]
    write(restored, 300, 301)
    assert rooms(restored) == [512] and np.array_equal(values(restored), np.array(data[:, :, :301]))
    batch = merge_caches([other, cache_from_snapshot(snap)])
    assert rooms(batch) == [300]
    write(batch, 300, 301, rows=2)
    assert rooms(batch) == [512] and np.array_equal(values(batch), np.array(mx.repeat(data[:, :, :301], 2, 0)))


@pytest.mark.parametrize("keep", [True, False], ids=["keep_row_pages", "plain"])
def test_merged_rows_share_their_pages_with_their_snapshots(kl_model, keep):
    """Caches of 39 and 19 tokens merged into a batch (its pages are copies: attention reads each page as one
    [2, 1, P, .] array), decoded 3 steps: with ``keep_row_pages`` each row's snapshot starts with the full pages its
    own cache had (the same objects: 2 and 1 pages) and copies the rest, and filtering down to the second row gives
    back its page; without it, they are copies. Either way each restored snapshot, and the filtered batch, continue
    like that row alone."""
    model = kl_model
    prompts = [_tokens(model, 40, 3), _tokens(model, 20, 4)]
    steps = [_tokens(model, 5, 5), _tokens(model, 5, 6)]
    own = []
    for p in prompts:
        own.append(model.make_cache())
        _feed(model, own[-1], [p[:-1]])
    alone = []
    for p, s in zip(prompts, steps):
        cache = model.make_cache()
        _feed(model, cache, [p[:-1]])
        alone.append([_feed(model, cache, [[t]])[0] for t in [p[-1], *s]])
    batch = merge_caches(own, keep_row_pages=keep)
    mine = {id(page) for c in own for page in _latent_pages(c)}
    assert not mine & {id(page) for page in _latent_pages(batch)}
    for k in range(3):
        logits = _feed(model, batch, [[prompts[r][-1] if k == 0 else steps[r][k - 1]] for r in (0, 1)])
        assert max(mx.abs(logits[r] - alone[r][k]).max().item() for r in (0, 1)) <= TOL
    for r, full in ((0, 2), (1, 1)):
        snap = batch.snapshot(r)
        assert snap.offset == len(prompts[r]) + 2
        for c, pages in zip(_latent(own[r]), _mla_states(snap)):
            shared = [a is b for a, b in zip(pages, c.pages)]
            assert shared == ([True] * full if keep else [False] * full) + [False] * (len(shared) - full)
        restored = cache_from_snapshot(snap)
        for k in range(3, 6):
            got = _feed(model, restored, [[steps[r][k - 1]]])[0]
            assert mx.abs(got - alone[r][k]).max().item() <= TOL
    batch.filter([1])
    assert all((c.pages[0] is o.pages[0]) == keep for c, o in zip(_latent(batch), _latent(own[1])))
    for k in range(3, 6):
        assert mx.abs(_feed(model, batch, [[steps[1][k - 1]]])[0] - alone[1][k]).max().item() <= TOL


def _latent_pages(cache) -> list[LatentPage]:
    return [page for c in _latent(cache) for page in c.pages]


def test_prefix_cache_counts_shared_pages_once(kl_model):
    """Snapshots of one sequence at 16, 40 and 50 tokens share their full pages: the prefix cache holds
    ``_chain_bytes`` (each full page once), less than the snapshots' summed sizes; removing the longest frees only
    what it alone held; under a budget one byte short of all three, inserting the third evicts the least recently
    used entry (16 tokens), which frees its KDA state only (its page is the others' too)."""
    model = kl_model
    tokens = _tokens(model, 50, 7)
    cache, snaps = model.make_cache(), []
    for a, b in ((0, 16), (16, 40), (40, 50)):
        _feed(model, cache, [tokens[a:b]])
        snaps.append(cache.snapshot())
    cfg = model.args
    pc = PrefixCache(None)
    for s in snaps:
        pc.insert(tokens[: s.offset], s, "message")
    assert pc.nbytes == _chain_bytes(cfg, [16, 40, 50]) < sum(s.nbytes for s in snaps)
    assert pc.stats()["bytes"] == pc.nbytes
    pc.remove([2])
    assert pc.nbytes == _chain_bytes(cfg, [16, 40])

    budget = PrefixCache(_chain_bytes(cfg, [16, 40, 50]) - 1)
    ids = [budget.insert(tokens[: s.offset], s, "message") for s in snaps]
    assert [evicted for _, evicted in ids] == [[], [], [ids[0][0]]]
    assert budget.nbytes == _chain_bytes(cfg, [40, 50])


def _conversation_lengths(prompts: list[list[int]], n: int) -> list[int]:
    """Snapshot lengths of a conversation's turns (prompts; ``n`` reply tokens each) on an engine without interval
    checkpoints or message boundaries: each prompt but its last token ("message") and prompt + reply but its last
    token ("reply")."""
    return [m for p in prompts for m in (len(p) - 1, len(p) + n - 1)]


@pytest.mark.parametrize("concurrent", [False, True], ids=["one-conversation", "two-at-once"])
def test_server_conversation_holds_each_page_once(kl_model, concurrent, monkeypatch):
    """A conversation of 4 turns (2 with two conversations sent at once, so their rows are merged into one decode
    batch and their replies snapshotted from it) on the serving engine: the prefix cache holds exactly each chain's
    ``_chain_bytes`` (its stats, what ``/health`` reports), and a turn reuses all the previous one saw."""
    import kimi_mlx.server.scheduler as scheduler

    merged = []
    monkeypatch.setattr(scheduler, "merge_caches", lambda caches, **kw: merged.append(len(caches)) or
                        merge_caches(caches, **kw))
    model, n, turns = kl_model, 6, 2 if concurrent else 4
    engine = Scheduler(model, max_batch=2, prefill_chunk=16, checkpoint_interval=0).start()
    try:
        conversations = [[_tokens(model, 40, 10)]] + ([[_tokens(model, 29, 11)]] if concurrent else [])
        for turn in range(turns):
            seen = [0 if len(c) == 1 else len(c[-2]) + n - 1 for c in conversations]
            streams = [engine.submit(GenerationRequest(c[-1], n)) for c in conversations]
            for c, stream, cached in zip(conversations, streams, seen):
                events = list(stream)
                assert events[-1].cached_tokens == cached
                if turn + 1 < turns:
                    c.append(c[-1] + [e.token for e in events[:-1]] + _tokens(model, 10, 20 + turn))
        stats = engine.stats["prefix_cache"]
    finally:
        engine.stop()
    assert merged == ([2] * turns if concurrent else [])
    assert stats["entries"] == sum(len(_conversation_lengths(c, n)) for c in conversations)
    assert stats["bytes"] == sum(_chain_bytes(model.args, _conversation_lengths(c, n)) for c in conversations)
