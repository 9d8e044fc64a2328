"""Snapshots inside one forward call: ``HybridCache.mark`` then ``snapshot(at=...)`` on the tiny Kimi Linear and
Kimi-K3 references (float32), against the same prompt fed in one call per snapshot point (what the server did before
marks) and against a cold cache.

Each KDA layer cuts its scan at a mark (the chunks restart there, as a new call's do), so the kept states are those
of separate calls up to the projections' rounding, and every snapshot restored and continued gives a cold cache's
logits within the bound of two prefill calls against one (``test_model_parity.CONSISTENCY_TOL``). Runs with the
default latent page size and with 3-position pages (marks then fall inside pages that the snapshot must cut).
"""

import mlx.core as mx
import numpy as np
import pytest

from kimi_mlx.cache import CheckpointError, KDACache, MLALatentCache, cache_from_snapshot
from test_model_parity import CONSISTENCY_TOL


@pytest.fixture(autouse=True, params=[4096, 3], ids=["page4096", "page3"])
def page_size(request, monkeypatch):
    monkeypatch.setattr(MLALatentCache, "page_size", request.param)
    return request.param


def _tokens(model, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, model.args.vocab_size, n).tolist()


def _feed(model, cache, tokens: list[int]) -> mx.array:
    """Feed ``tokens`` into a one-row ``cache``; the float32 logits of every position ``[T, vocab]``."""
    logits = model(mx.array(tokens)[None], cache=cache)[0].astype(mx.float32)
    mx.eval(logits, [c.state for c in cache])
    return logits


def _diff(a: mx.array, b: mx.array) -> float:
    return mx.abs(a - b).max().item()


MARKS = (7, 23, 24)  # two marks one token apart: a one-token segment between them
PROMPT = 40  # > 32 tokens: the last segment runs the chunked scan (chunk 16) with a padded tail


def test_marked_call_equals_one_call_per_snapshot_point(arch):
    """One 40-token call marked at 7, 23 and 24: its logits are the unmarked call's (within the bound), and the snapshots
    at the marks and at the end hold what the same prompt fed in calls of 7, 16, 1 and 16 tokens held there (the
    offsets, the latent positions, KDA states within the bound)."""
    model, tol = arch[3], CONSISTENCY_TOL[arch[0]]
    prompt = _tokens(model, PROMPT, 1)
    marked = model.make_cache()
    marked.mark(MARKS)
    logits = _feed(model, marked, prompt)
    assert _diff(logits, _feed(model, model.make_cache(), prompt)) <= tol

    split, refs, a = model.make_cache(), [], 0
    for b in (*MARKS, PROMPT):
        _feed(model, split, prompt[a:b])
        refs.append(split.snapshot())
        a = b
    for at, ref in zip((*MARKS, PROMPT), refs):
        snap = marked.snapshot(at=at)
        assert snap.offset == ref.offset == at and snap.kda_layers == ref.kda_layers
        for is_kda, mine, theirs in zip(snap.kda_layers, snap.states, ref.states):
            if is_kda:
                assert all(x.shape == y.shape and _diff(x, y) <= tol for x, y in zip(mine, theirs))
            else:
                assert [p.size for p in mine] == [p.size for p in theirs] and sum(p.size for p in mine) == at
                assert all(_diff(x, y) <= tol for p, q in zip(mine, theirs) for x, y in zip(p.arrays, q.arrays))


def test_marked_snapshots_continue_like_a_cold_cache(arch):
    """Each snapshot of a marked call, restored into a fresh cache and fed the rest of the prompt and 3 decode
    steps, gives the logits of a fresh cache fed the prompt up to the mark, then the rest and those steps (the call
    per snapshot point it replaces), and, float, of a cold cache fed the whole prompt in one call; Kimi Linear also
    with an 8-bit latent cache (a quantized snapshot is cut at the mark as stored; K3's tiny router flips an expert
    on an 8-bit latent's rounding, test_kv_quant.py, so its logits move by more than the float bound whenever a
    GEMM rounds differently). The marked cache itself goes on (float: like the cold cache), and a later mark drops
    the states kept for the earlier ones."""
    model, tol = arch[3], CONSISTENCY_TOL[arch[0]]
    prompt, steps = _tokens(model, PROMPT, 2), _tokens(model, 3, 3)

    def run(c, parts):  # the last position's logits after each part, then after each decode step
        return [_feed(model, c, p)[-1] for p in parts] + [_feed(model, c, [t])[-1] for t in steps]

    for kv_bits in (None, 8) if arch[0] == "kimi_linear" else (None,):
        cache = model.make_cache(kv_bits=kv_bits)
        cache.mark(MARKS)
        _feed(model, cache, prompt)
        snaps = {at: cache.snapshot(at=at) for at in MARKS}
        assert all(snap.kv_quant == cache.kv_quant for snap in snaps.values())
        cold = run(model.make_cache(kv_bits=kv_bits), [prompt])
        for at, snap in snaps.items():
            got = run(cache_from_snapshot(snap), [prompt[at:]])
            split = run(model.make_cache(kv_bits=kv_bits), [prompt[:at], prompt[at:]])[1:]
            assert max(_diff(g, r) for g, r in zip(got, split)) <= tol, (kv_bits, at)
            assert max(_diff(g, r) for g, r in zip(got, cold)) <= tol, (kv_bits, at)
        cache.mark([PROMPT + 2])
        assert all(c.kept == {} for c in cache if isinstance(c, KDACache))
        got = [_feed(model, cache, [t])[-1] for t in steps]
        assert max(_diff(g, r) for g, r in zip(got, cold[1:])) <= tol


def test_marks_refuse_what_they_cannot_give(kl_model):
    """A mark at or before the cache's offset is refused; a snapshot at an offset no call kept names that offset
    and the kept ones; a restore drops the kept states; an offset beyond the cache is refused."""
    model = kl_model
    cache = model.make_cache()
    _feed(model, cache, _tokens(model, 5, 4))
    with pytest.raises(ValueError, match="after the cache's offset 5"):
        cache.mark([5, 9])
    cp = cache.checkpoint()
    cache.mark([9])
    _feed(model, cache, _tokens(model, 10, 5))
    assert cache.snapshot(at=9).offset == 9
    with pytest.raises(CheckpointError, match=r"no KDA state kept at offset 8 \(cache at 15, kept at \[9\]\)"):
        cache.snapshot(at=8)
    with pytest.raises(ValueError, match="cannot snapshot at offset 16 of a cache of 15 tokens"):
        cache.snapshot(at=16)
    cache.restore(cp)
    _feed(model, cache, _tokens(model, 10, 5))
    with pytest.raises(CheckpointError, match="no KDA state kept at offset 9"):
        cache.snapshot(at=9)
