"""``HybridCache.trim(n)``: drop the last n tokens through the checkpoint taken at offset − n (the roll-back of
speculative decoding), on the tiny Kimi Linear and Kimi-K3 references (float32 weights).

The reference is a recomputation: a cache fed k tokens, checkpointed, fed j more (a prefill chunk and decode steps),
then trimmed by j, holds bitwise the latents and KDA conv + recurrent states of a cache fed only the k tokens, and
continues with bitwise the same logits. Float and 8-bit latents, one row and a left-padded batch, default pages and
3-position pages (so the trim releases pages and cuts one).
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from kimi_mlx.cache import CheckpointError, MLALatentCache

K, J = 7, 5  # tokens kept, tokens trimmed


@pytest.fixture(params=[4096, 3], ids=["page4096", "page3"])
def page_size(request, monkeypatch):
    monkeypatch.setattr(MLALatentCache, "page_size", request.param)
    return request.param


def _tokens(model, rows: int, n: int, seed: int) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(0, model.args.vocab_size, (rows, n)))


def _feed(model, cache, tokens: mx.array) -> mx.array:
    """Feed ``tokens`` [B, T]; the float32 logits ``[B, T, vocab]``."""
    logits = model(tokens, cache=cache).astype(mx.float32)
    mx.eval(logits, [c.state for c in cache])
    return logits


def _same_states(cache, ref) -> bool:
    """Every layer holds bitwise the arrays of ``ref``'s (MLA: the filled latent pages; KDA: conv + recurrent)."""
    if [len(c.state) for c in cache] != [len(c.state) for c in ref]:
        return False
    pairs = [(x, y) for a, b in zip(cache, ref) for x, y in zip(a.state, b.state)]
    return all(x.dtype == y.dtype and mx.array_equal(x, y) for x, y in pairs)


@pytest.mark.parametrize("padding", [None, [0, 3]], ids=["one_row", "left_padded"])
@pytest.mark.parametrize("kv_bits", [None, 8], ids=["float", "8bit"])
def test_trim_equals_the_cache_fed_fewer_tokens(arch, kv_bits, padding, page_size):
    """k tokens, checkpoint, j more (a chunk of 3 then 2 decode steps), ``trim(j)``: the cache equals one fed the k
    tokens alone (offsets, latents, KDA states bitwise), and feeding both the same 4 tokens (a chunk, then a decode
    step) gives bitwise the same logits."""
    model = arch[3]
    kv = {} if kv_bits is None else {"kv_bits": kv_bits, "kv_group_size": 32}
    rows = 1 if padding is None else len(padding)
    prefix, more, after = _tokens(model, rows, K, 0), _tokens(model, rows, J, 1), _tokens(model, rows, 4, 2)

    cache = model.make_cache(left_padding=padding, **kv)
    _feed(model, cache, prefix)
    cache.checkpoint()
    _feed(model, cache, more[:, :3])
    for i in range(3, J):
        _feed(model, cache, more[:, i : i + 1])
    assert cache.offset == K + J
    assert cache.trim(J) == J
    assert cache.offset == K and all(c.offset == K for c in cache)

    ref = model.make_cache(left_padding=padding, **kv)
    _feed(model, ref, prefix)
    assert cache.kv_quant == ref.kv_quant and _same_states(cache, ref)
    assert mx.array_equal(_feed(model, cache, after[:, :3]), _feed(model, ref, after[:, :3]))
    assert mx.array_equal(_feed(model, cache, after[:, 3:]), _feed(model, ref, after[:, 3:]))
    assert _same_states(cache, ref)


def test_trim_goes_back_to_a_step_checkpoint_and_drops_the_later_ones(kl_model):
    """A checkpoint before each decode step (as a speculative verifier would take them): ``trim(2)`` restores the one
    two steps back, drops the later ones and leaves that one restorable; the cache equals one fed up to there."""
    model = kl_model
    toks = _tokens(model, 1, 9, 3)
    cache = model.make_cache()
    _feed(model, cache, toks[:, :6])
    cps = []
    for i in range(6, 9):
        cps.append(cache.checkpoint())
        _feed(model, cache, toks[:, i : i + 1])
    assert cache.trim(2) == 2
    assert cache.offset == 7 and cache.checkpoints == cps[:2]
    ref = model.make_cache()  # the same split: a prefill of 6, one decode step
    _feed(model, ref, toks[:, :6])
    _feed(model, ref, toks[:, 6:7])
    assert _same_states(cache, ref)
    _feed(model, cache, toks[:, 7:9])
    assert cache.trim(2) == 2 and cache.offset == 7 and _same_states(cache, ref)


def test_trim_needs_a_checkpoint_and_mlx_lm_still_sees_an_untrimmable_cache(kl_model):
    """Without a checkpoint at offset − n ``trim`` raises ``CheckpointError`` naming the offsets it has and changes
    nothing; ``trim(0)`` is a no-op; n past the offset is refused. mlx-lm's protocol is unchanged: a KDA layer is not
    trimmable, so ``can_trim_prompt_cache`` is False and ``trim_prompt_cache`` drops nothing."""
    model = kl_model
    cache = model.make_cache()
    _feed(model, cache, _tokens(model, 1, 4, 4))
    cache.checkpoint()
    _feed(model, cache, _tokens(model, 1, 3, 5))
    ref = model.make_cache()
    _feed(model, ref, _tokens(model, 1, 4, 4))
    _feed(model, ref, _tokens(model, 1, 3, 5))
    with pytest.raises(CheckpointError, match=r"no checkpoint at offset 5 .*checkpoints at offsets \[4\]"):
        cache.trim(2)
    with pytest.raises(ValueError, match="cannot trim 8 tokens from a cache of 7"):
        cache.trim(8)
    assert cache.trim(0) == 0
    assert cache.offset == 7 and len(cache.checkpoints) == 1 and _same_states(cache, ref)

    assert not can_trim_prompt_cache(cache)
    assert trim_prompt_cache(cache, 3) == 0 and cache.offset == 7 and _same_states(cache, ref)
