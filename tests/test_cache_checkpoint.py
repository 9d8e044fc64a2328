"""Cache checkpoints (``HybridCache.checkpoint`` / ``restore``) on the tiny Kimi Linear and Kimi-K3 references.

The reference for "restore, then continue" is a fresh prefill of the same token sequence on a new cache.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from kimi_mlx.cache import CheckpointError, HybridCache, KDACache, MLALatentCache


def _tokens(model, n: int, seed: int) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array(rng.integers(0, model.args.vocab_size, n))


def _feed(model, cache, tokens: mx.array) -> mx.array:
    """Prefill ``tokens`` into ``cache``; returns the float32 logits ``[T, vocab]``."""
    logits = model(tokens[None], cache=cache)[0].astype(mx.float32)
    mx.eval(logits, [c.state for c in cache])
    return logits


def _decode(model, cache, logits: mx.array, n: int) -> list[int]:
    """Greedy-decode ``n`` tokens one at a time after ``logits`` (the last row is used)."""
    out = []
    for _ in range(n):
        tok = int(mx.argmax(logits[-1]).item())
        out.append(tok)
        logits = _feed(model, cache, mx.array([tok]))
    return out


def test_make_cache_is_a_hybrid_list(arch):
    """``model.make_cache()`` is a list (mlx-lm's protocol) of KDA / MLA layer caches with checkpoint support."""
    _, _, _, model = arch
    cache = model.make_cache(max_checkpoints=3)
    assert isinstance(cache, HybridCache) and isinstance(cache, list) and len(cache) == len(model.layers)
    assert [isinstance(c, KDACache) for c in cache] == [layer.is_linear for layer in model.layers]
    assert any(isinstance(c, MLALatentCache) for c in cache) and cache.max_checkpoints == 3


def test_restore_then_continue_equals_fresh_prefill(arch):
    """Prompt A, checkpoint, decode 6 tokens, restore, then feed a different continuation C (prefill of 9 tokens
    then 3 decode steps): the logits are bitwise equal to a fresh cache fed A then C (no detour), and within 2e-5
    of a fresh cache fed A + C in one prefill. (That last gap is float32 noise of split vs single prefill, present
    without any checkpoint: measured up to 1.25e-5 on K3 and 4.4e-6 on Kimi Linear, logits of magnitude ~3.)"""
    _, _, _, model = arch
    a, c = _tokens(model, 23, 0), _tokens(model, 9, 1)
    cache = model.make_cache()
    first = _feed(model, cache, a)
    cp = cache.checkpoint()
    _decode(model, cache, first, 6)
    assert cache.offset == 23 + 6
    cache.restore(cp)
    assert cache.offset == 23 and all(layer.offset == 23 for layer in cache)
    restored = _feed(model, cache, c)
    tail = mx.array(_decode(model, cache, restored, 3))

    fresh = _feed(model, model.make_cache(), mx.concatenate([a, c, tail]))
    assert mx.abs(restored - fresh[23:32]).max().item() <= 2e-5

    straight = model.make_cache()
    _feed(model, straight, a)
    assert mx.array_equal(_feed(model, straight, c), restored)

    # decode after restore: the logits of the 3 decode steps equal the fresh prefill's rows too
    cache.restore(cp)
    _feed(model, cache, c)
    steps = mx.concatenate([_feed(model, cache, tail[i : i + 1]) for i in range(3)])
    assert mx.abs(steps - fresh[32:35]).max().item() <= 2e-5
    straight_steps = mx.concatenate([_feed(model, straight, tail[i : i + 1]) for i in range(3)])
    assert mx.array_equal(steps, straight_steps)


def test_regenerate_under_mlx_lm_generate_step(arch):
    """mlx-lm's ``generate_step`` runs on a ``HybridCache``; restoring the checkpoint taken after the prompt and
    generating again gives the same greedy tokens, and the cache offset counts prompt + yielded tokens."""
    _, _, _, model = arch
    prompt = _tokens(model, 17, 2)
    cache = model.make_cache()
    _feed(model, cache, prompt)
    cp = cache.checkpoint()
    first = [t for t, _ in generate_step(_tokens(model, 4, 3), model, max_tokens=8, prompt_cache=cache)]
    assert cache.offset == 17 + 4 + 8
    cache.restore(cp)
    again = [t for t, _ in generate_step(_tokens(model, 4, 3), model, max_tokens=8, prompt_cache=cache)]
    assert first == again


def test_checkpoints_are_bounded_and_ordered(kl_model):
    """Only the last ``max_checkpoints`` are kept; restoring one drops the later ones; each failure names why."""
    model = kl_model
    cache = model.make_cache(max_checkpoints=2)
    cps = []
    for i in range(3):
        _feed(model, cache, _tokens(model, 5, 10 + i))
        cps.append(cache.checkpoint())
    assert cache.checkpoints == cps[1:]
    assert cps[1].nbytes > 0 and cache.nbytes >= cps[1].nbytes + cps[2].nbytes
    with pytest.raises(CheckpointError, match="offset 5 was released"):
        cache.restore(cps[0])
    cache.restore(cps[1])
    assert cache.offset == 10 and cache.checkpoints == [cps[1]]
    with pytest.raises(CheckpointError, match="released"):
        cache.restore(cps[2])
    with pytest.raises(CheckpointError, match="another cache"):
        model.make_cache().restore(cps[1])
    with pytest.raises(ValueError, match="max_checkpoints must be >= 1"):
        model.make_cache(max_checkpoints=0)


def test_checkpoint_of_empty_cache_and_reset(kl_model):
    """A checkpoint of an empty cache restores to empty (KDA states None, MLA offset 0); ``reset`` empties the cache
    and drops checkpoints, and the next prefill equals a fresh one."""
    model = kl_model
    cache = model.make_cache()
    cp = cache.checkpoint()
    toks = _tokens(model, 7, 4)
    ref = _feed(model, cache, toks)
    cache.restore(cp)
    assert cache.offset == 0 and all(c.empty() for c in cache)
    assert mx.array_equal(_feed(model, cache, toks), ref)
    cache.reset()
    assert cache.offset == 0 and cache.checkpoints == []
    assert mx.array_equal(_feed(model, cache, toks), ref)
