"""Batch caches for serving: ``merge_caches``, ``HybridCache.filter``, ``snapshot`` / ``cache_from_snapshot`` on the
tiny Kimi Linear and Kimi-K3 references (float32).

The reference for every row is that row alone on a cold cache: its prompt but the last token prefilled, then one
token per decode step (the same split, so the only difference is batching). Measured: merged and filtered batches
decode bitwise like each row alone, a restored snapshot continues bitwise like the cold cache, and a row snapshotted
from a left-padded batch is within 5.9e-6 (K3; 2.1e-6 Kimi Linear) of its prompt prefilled alone (the padded
prefill's own float32 noise). Every test runs with the default latent page size and with 3-position pages (the
rows' 1-9 positions then span pages that merges, filters and snapshots must cut and re-stack at other offsets).
"""

import mlx.core as mx
import numpy as np
import pytest

from kimi_mlx.cache import (CacheSnapshot, KDACache, LatentPage, MLALatentCache, cache_from_snapshot, make_cache,
                            merge_caches)

TOL = 1e-5


@pytest.fixture(autouse=True, params=[4096, 3], ids=["page4096", "page3"])
def page_size(request, monkeypatch):
    monkeypatch.setattr(MLALatentCache, "page_size", request.param)
    return request.param


def _latent_shape(c: MLALatentCache) -> tuple:
    """[B, 1, S] of the filled latent (all pages)."""
    return c.whole()[0].shape[:3]


def _tokens(model, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, model.args.vocab_size, n).tolist()


def _feed(model, cache, tokens: list[list[int]]) -> mx.array:
    """Feed ``tokens`` [B, T] into ``cache``; returns the float32 logits of the last position ``[B, vocab]``."""
    logits = model(mx.array(tokens), cache=cache)[:, -1].astype(mx.float32)
    mx.eval(logits, [c.state for c in cache])
    return logits


def _alone(model, prompt: list[int], steps: list[int]) -> list[mx.array]:
    """One row alone on a cold cache: ``prompt[:-1]`` prefilled, then ``prompt[-1]`` and each of ``steps`` decoded
    one at a time; the logits ``[vocab]`` of each decode step."""
    cache = model.make_cache()
    if len(prompt) > 1:
        _feed(model, cache, [prompt[:-1]])
    return [_feed(model, cache, [[t]])[0] for t in [prompt[-1], *steps]]


class Rows:
    """Four prompts held in three caches at different offsets, merged into one batch:

    - a left-padded batch of two rows, prompts of 5 and 3 tokens (offset 4, padding [0, 2]),
    - one row with a 9-token prompt (offset 8),
    - one row with a 1-token prompt (offset 0: nothing prefilled, only its last prompt token pending).
    """

    def __init__(self, model):
        self.model = model
        self.prompts = [_tokens(model, n, seed) for n, seed in ((5, 1), (3, 2), (9, 3), (1, 4))]
        self.steps = [_tokens(model, 8, 10 + i) for i in range(4)]  # forced tokens after the prompt, per row
        self.ref = [_alone(model, p, s) for p, s in zip(self.prompts, self.steps)]
        c, d, a, b = self.prompts
        pair = model.make_cache(left_padding=[0, 2])
        _feed(model, pair, [c[:-1], [0, 0] + d[:-1]])
        single = model.make_cache()
        _feed(model, single, [a[:-1]])
        self.caches = [pair, single, model.make_cache()]

    def decode(self, cache, rows: list[int], step: int) -> float:
        """Feed decode step ``step`` (0: the last prompt token) of ``rows`` into ``cache``; the max error against
        each row alone."""
        toks = [[self.prompts[r][-1] if step == 0 else self.steps[r][step - 1]] for r in rows]
        logits = _feed(self.model, cache, toks)
        return max(mx.abs(logits[i] - self.ref[r][step]).max().item() for i, r in enumerate(rows))


def test_merge_then_decode_matches_each_row_alone(arch):
    """A merge of a two-row padded batch, a single row at offset 8 and an empty cache (offset 0): the batch is at
    offset 8 with each row's padding recorded, and 4 decode steps give every row's logits as when it runs alone."""
    rows = Rows(arch[3])
    merged = merge_caches(rows.caches)
    assert merged.offset == 8 and all(c.offset == 8 for c in merged)
    assert merged[0].left_padding.tolist() == [4, 6, 0, 8]
    assert all(c.left_padding is merged[0].left_padding for c in merged)
    for c in merged:
        if isinstance(c, MLALatentCache):
            assert _latent_shape(c) == (4, 1, 8) and c.whole()[1].shape[:3] == (4, 1, 8)
        else:
            assert c.conv_state.shape[0] == 4 and c.recurrent_state.shape[0] == 4
    err = max(rows.decode(merged, [0, 1, 2, 3], step) for step in range(4))
    assert err <= TOL, err


def test_filter_then_decode_continues_exactly(arch):
    """After 2 merged decode steps, keeping rows 3 and 1 (paddings 8 and 6) drops their 6 shared pad positions;
    3 more steps match each row alone; keeping row 3 alone then drops all padding and 2 more steps still match."""
    rows = Rows(arch[3])
    cache = merge_caches(rows.caches)
    cache.checkpoint()
    err = max(rows.decode(cache, [0, 1, 2, 3], step) for step in range(2))
    cache.filter([3, 1])
    assert cache.offset == 4 and all(c.offset == 4 for c in cache)
    assert cache[0].left_padding.tolist() == [2, 0] and cache.checkpoints == []
    assert all(_latent_shape(c) == (2, 1, 4) for c in cache if isinstance(c, MLALatentCache))
    err = max(err, *(rows.decode(cache, [3, 1], step) for step in range(2, 5)))
    cache.filter([0])
    assert cache.offset == 5 and all(c.left_padding is None for c in cache)
    err = max(err, *(rows.decode(cache, [3], step) for step in range(5, 7)))
    assert err <= TOL, err


def test_merge_of_one_cache_changes_nothing(kl_model):
    """Merging a single padded cache gives a copy that decodes bitwise like the original."""
    rows = Rows(kl_model)
    twin = Rows(kl_model).caches[0]
    merged = merge_caches([rows.caches[0]])
    for step in range(3):
        toks = [[rows.prompts[r][-1] if step == 0 else rows.steps[r][step - 1]] for r in (0, 1)]
        assert mx.array_equal(_feed(kl_model, merged, toks), _feed(kl_model, twin, toks))


def test_merge_and_filter_refuse_bad_input(kl_model):
    """Mismatched layer layouts, no caches, and rows out of range are refused with a reason."""
    with pytest.raises(ValueError, match="different layer layouts"):
        merge_caches([make_cache([True, False]), make_cache([False, True])])
    with pytest.raises(ValueError, match="at least one cache"):
        merge_caches([])
    cache = kl_model.make_cache(left_padding=[1, 0])
    with pytest.raises(IndexError, match="rows"):
        cache.filter([2])
    with pytest.raises(IndexError, match="rows"):
        cache.filter([])
    with pytest.raises(IndexError, match="row 2 out of range"):
        cache.snapshot(2)


def test_merge_of_empty_caches_stays_empty(kl_model):
    """Caches at offset 0 merge into an empty batch (no states, no padding) whose prefill equals each row alone."""
    model = kl_model
    merged = merge_caches([model.make_cache(), model.make_cache()])
    assert merged.offset == 0 and all(c.left_padding is None and c.state == [] for c in merged)
    a, b = _tokens(model, 4, 5), _tokens(model, 4, 6)
    logits = _feed(model, merged, [a, b])
    for row, toks in enumerate((a, b)):
        assert mx.abs(logits[row] - _feed(model, model.make_cache(), [toks])[0]).max().item() <= TOL


def test_snapshot_then_continue_equals_cold_prefill(arch):
    """A snapshot after a 10-token prompt, restored into a fresh cache and fed a 5-token prefill and 3 decode steps,
    gives the logits of a cold cache fed the same tokens; the source cache going on does not change the snapshot.
    A snapshot of an empty cache restores to an empty cache."""
    model = arch[3]
    prompt, more, steps = _tokens(model, 10, 20), _tokens(model, 5, 21), _tokens(model, 3, 22)
    cache = model.make_cache()
    _feed(model, cache, [prompt])
    snap = cache.snapshot()
    assert isinstance(snap, CacheSnapshot) and snap.offset == 10
    assert snap.kda_layers == tuple(isinstance(c, KDACache) for c in cache)
    assert snap.nbytes == sum(c.nbytes for c in cache)
    _feed(model, cache, [more])  # the source cache goes on

    cold = model.make_cache()
    _feed(model, cold, [prompt])
    for restored in (cache_from_snapshot(snap, max_checkpoints=3), cache_from_snapshot(snap)):
        assert restored.offset == 10 and all(c.offset == 10 for c in restored)
        err = mx.abs(_feed(model, restored, [more]) - _feed(model, cold, [more])).max().item()
        for t in steps:
            err = max(err, mx.abs(_feed(model, restored, [[t]]) - _feed(model, cold, [[t]])).max().item())
        assert err <= TOL, err
        cold = model.make_cache()
        _feed(model, cold, [prompt])

    empty = model.make_cache().snapshot()
    assert empty.offset == 0 and empty.nbytes == 0
    assert all(s == ((None, None) if kda else ()) for kda, s in zip(empty.kda_layers, empty.states))
    restored = cache_from_snapshot(empty)
    assert mx.array_equal(_feed(model, restored, [prompt]), _feed(model, model.make_cache(), [prompt]))


def test_snapshot_of_a_left_padded_row(arch):
    """In a batch of a 7-token and a 4-token prompt (padding [0, 3]), the second row's snapshot holds 4 positions
    and no padding; restored, it decodes 3 steps like that prompt prefilled alone on a cold cache."""
    model = arch[3]
    p, q, steps = _tokens(model, 7, 30), _tokens(model, 4, 31), _tokens(model, 3, 32)
    batch = model.make_cache(left_padding=[0, 3])
    _feed(model, batch, [p, [0, 0, 0] + q])
    snap = batch.snapshot(1)
    assert snap.offset == 4 and batch.snapshot(0).offset == 7
    for is_kda, state in zip(snap.kda_layers, snap.states):
        if is_kda:
            assert state[0].shape[0] == 1 and state[1].shape[0] == 1
        else:
            assert all(p.rows == 1 for p in state) and sum(p.size for p in state) == 4
    restored, cold = cache_from_snapshot(snap), model.make_cache()
    _feed(model, cold, [q])
    assert restored[0].left_padding is None
    err = max(mx.abs(_feed(model, restored, [[t]]) - _feed(model, cold, [[t]])).max().item() for t in steps)
    assert err <= TOL, err


def test_snapshot_is_independent_of_its_caches(page_size):
    """A batch row's snapshot is a copy: it keeps no batch buffer alive (once the caches are gone, only its own bytes
    stay allocated, far less than the 3-row batch), and neither the source cache nor a cache restored from it can
    write into it, also after a trim (the next write lands inside an existing page)."""
    rng = np.random.default_rng(0)

    def rand(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    def fill(cache, n):
        cache[0].update_and_fetch(rand(3, 1, n, 512), rand(3, 1, n, 64))
        cache[1].conv_state, cache[1].recurrent_state = rand(3, 3, 960), rand(3, 4, 32, 32)
        cache[1].advance(n)
        mx.eval([c.state for c in cache])

    mx.eval(rand(1))
    before = mx.get_active_memory()
    cache = make_cache([False, True], left_padding=[2, 0, 1])
    fill(cache, 5)
    snap = cache.snapshot(1)
    kept = [np.array(a) for h in snap.holders() for a in (h.arrays if isinstance(h, LatentPage) else [h])]
    assert snap.offset == 5 and [p.size for p in snap.states[0]] == ([5] if page_size > 5 else [3, 2])

    cache[0].trim(3)
    fill(cache, 2)  # writes positions 2-3 inside the source's pages
    restored = cache_from_snapshot(snap)
    restored[0].trim(3)
    restored[0].update_and_fetch(rand(1, 1, 2, 512), rand(1, 1, 2, 64))  # inside the snapshot's own pages
    mx.eval(restored[0].state)
    now = [np.array(a) for h in snap.holders() for a in (h.arrays if isinstance(h, LatentPage) else [h])]
    assert all(np.array_equal(k, a) for k, a in zip(kept, now))

    del cache, restored
    batch = 3 * -(-5 // page_size) * page_size * (512 + 64) * 4  # the batch's latent pages: 3 rows, 5 positions
    assert mx.get_active_memory() - before <= snap.nbytes + 16384 < snap.nbytes + batch  # 16 KiB: index arrays
