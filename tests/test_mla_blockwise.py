"""Blockwise MLA attention (ops/mla_attention.py): equals the fused single-block path, bounds prefill memory."""

import mlx.core as mx
import pytest

import kimi_mlx.ops.mla_attention as mla_ops
from kimi_mlx.cache import MLALatentCache, _width, reserve_cache
from kimi_mlx.models.kimi_linear import attention_mask

FUSED = 10**9  # a key block larger than any cache here: the fused path the layer had before blockwise attention


def mla_layers(model):
    return [layer.self_attn for layer in model.layers if not layer.is_linear]


def set_key_block(model, key_block: int) -> None:
    for attn in mla_layers(model):
        attn.key_block = key_block


def layer_chunk(attn, x, prefix: int, left_padding, key_block: int) -> mx.array:
    """The layer's output for x[:, prefix:] after x[:, :prefix] went into a fresh latent cache."""
    attn.key_block = key_block
    cache = MLALatentCache(None if left_padding is None else mx.array(left_padding))
    T = x.shape[1] - prefix
    if prefix:
        attn(x[:, :prefix], attention_mask(prefix, 0, cache.left_padding), cache)
    return attn(x[:, prefix:], attention_mask(T, prefix, cache.left_padding), cache)


@pytest.mark.parametrize("absorbed_max", [0, 10**6], ids=["expanded", "absorbed"])
@pytest.mark.parametrize(
    "prefix,T,left_padding",
    [
        (0, 40, None),  # prefill from empty, 3 blocks, the last partial
        (16, 16, None),  # exactly 2 full blocks
        (63, 1, None),  # decode over 4 blocks
        (64, 1, None),  # decode over 5 blocks, the last with one key
        (33, 7, None),  # chunk straddling a block boundary
        (100, 37, [0, 29]),  # ragged batch: bool mask, one row's first blocks entirely padding
        (70, 1, [5, 40]),  # ragged decode
        (8, 9, [3, 0]),  # 2 blocks, padding inside the first
    ],
)
@pytest.mark.parametrize("arch_name", ["kl_model", "k3_model"])
def test_layer_blockwise_equals_fused(request, arch_name, prefix, T, left_padding, absorbed_max, monkeypatch):
    model = request.getfixturevalue(arch_name)
    attn = mla_layers(model)[0]
    monkeypatch.setattr(mla_ops, "ABSORBED_MAX_QUERIES", absorbed_max)
    B = 1 if left_padding is None else len(left_padding)
    x = mx.random.normal((B, prefix + T, model.args.hidden_size), key=mx.random.key(prefix * 1000 + T))
    try:
        ref = layer_chunk(attn, x, prefix, left_padding, FUSED)
        out = layer_chunk(attn, x, prefix, left_padding, 16)
    finally:
        attn.key_block = mla_ops.KEY_BLOCK
    err = mx.abs(out - ref).max().item()
    assert err <= 1e-5 * max(1.0, mx.abs(ref).max().item()), err



@pytest.fixture
def kl_blocks(kl_model):
    """The Kimi Linear fixture; its MLA layers get the default key block back afterwards."""
    yield kl_model
    set_key_block(kl_model, mla_ops.KEY_BLOCK)


def decode_vs_full(model, n: int, chunk: int, key_block: int, steps: int = 3) -> float:
    """Max |logit difference| / max |logit| between a full forward (fused attention) over n + steps tokens and a
    prefill of n tokens in ``chunk``-token chunks followed by ``steps`` decode steps, with ``key_block``."""
    tokens = mx.random.randint(0, model.args.vocab_size, (1, n + steps), key=mx.random.key(n))
    set_key_block(model, FUSED)
    full = model(tokens)[:, n - 1 :]
    mx.eval(full)
    set_key_block(model, key_block)
    cache = model.make_cache()
    for s in range(0, n, chunk):
        logits = model(tokens[:, s : min(s + chunk, n)], cache=cache)
        mx.eval(logits)
    out = [logits[:, -1:]]
    for i in range(n, n + steps):
        out.append(model(tokens[:, i : i + 1], cache=cache))
        mx.eval(out[-1])
    out = mx.concatenate(out, axis=1)[:, :-1]
    return (mx.abs(out - full[:, :-1]).max() / mx.abs(full).max()).item()


def test_decode_after_long_prefill_equals_full_forward(kl_blocks):
    """4096 tokens with 64-key blocks (64 blocks); ``bench/bench_mla_attention.py --long`` runs 16K tokens."""
    assert decode_vs_full(kl_blocks, 4093, 1024, 64) < 1e-5


def chunk_transient_memory(model, context: int, chunk: int, **kv) -> int:
    """Bytes a ``chunk``-token prefill chunk needs beyond weights, inputs and cache, after ``context`` tokens.

    The first chunk is real; the MLA latent caches are then filled up to ``context`` with random latents (attention
    cost and memory depend only on their length) so long contexts are cheap to reach, with room for the chunk (so
    this measures attention, not the cache's growth by copying, which costs one cache size)."""
    tokens = mx.random.randint(0, model.args.vocab_size, (1, 2 * chunk), key=mx.random.key(0))
    cache = model.make_cache(**kv)
    mx.eval(model(tokens[:, :chunk], cache=cache))
    fill = context - chunk
    for layer, c in zip(model.layers, cache):
        if layer.is_linear:
            c.advance(fill)
        else:
            shapes = (model.args.kv_lora_rank, model.args.qk_rope_head_dim)
            c.update_and_fetch(*(mx.random.normal((1, 1, fill + chunk, d)) for d in shapes))
            c.trim(chunk)
    mx.eval([c.state for c in cache])
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(model(tokens[:, chunk:], cache=cache))
    return mx.get_peak_memory() - base


@pytest.mark.parametrize("kv", [{}, {"kv_bits": 8, "kv_group_size": 64}], ids=["float", "kv8"])
def test_prefill_memory_independent_of_context(kl_blocks, kv):
    """float32: a 512-token chunk after 32K tokens needs <= 1.25x the memory of one after 4K (scaled down from 2048-token
    chunks at 8K vs 64K, which bench/bench_mla_attention.py --memory measures: a minute on two cores); the same with
    an 8-bit latent cache (its prefill dequantizes one key block at a time)."""
    set_key_block(kl_blocks, mla_ops.KEY_BLOCK)
    short = chunk_transient_memory(kl_blocks, 4096, 512, **kv)
    long = chunk_transient_memory(kl_blocks, 32768, 512, **kv)
    assert long <= 1.25 * short, (short / 2**20, long / 2**20)


@pytest.mark.parametrize("kv", [{}, {"kv_bits": 8, "kv_group_size": 64}], ids=["float", "kv8"])
def test_reserved_cache_allocates_once(kl_blocks, kv):
    """``reserve_cache(cache, n)``: the first chunk allocates room for n positions and later chunks write into that
    buffer (no regrowth: each growth copies the filled cache, a transient of its size); logits as without it."""
    tokens = mx.random.randint(0, kl_blocks.args.vocab_size, (1, 700), key=mx.random.key(1))
    plain, reserved = kl_blocks.make_cache(**kv), kl_blocks.make_cache(**kv)
    reserve_cache(reserved, 1000)
    latent = [c for c in reserved if isinstance(c, MLALatentCache)]
    widths, plain_widths = set(), set()
    for start in range(0, 700, 100):
        chunk = tokens[:, start : start + 100]
        want, got = kl_blocks(chunk, cache=plain), kl_blocks(chunk, cache=reserved)
        assert mx.array_equal(got, want)
        widths.update(_width(c.kv_latent) for c in latent)
        plain_widths.update(_width(c.kv_latent) for c in plain if isinstance(c, MLALatentCache))
    assert widths == {1024}
    assert plain_widths == {256, 456, 656, 856}  # without: allocated, then regrown (copied) 3 times


def test_auto_key_block_bounds_scores_and_matches_small_blocks(kl_blocks):
    """``key_block=None`` (the layers' default): blocks of ``auto_key_block`` keys, whose float32 scores fit
    SCORE_BUDGET_BYTES whatever the context (decode: few large blocks; expanded prefill chunks: 512); decode and
    prefill equal 64-key blocks within 1e-5."""
    budget = mla_ops.SCORE_BUDGET_BYTES
    for B, H, T in [(1, 32, 1), (1, 32, 128), (4, 2, 1), (1, 2, 100), (1, 64, 4096)]:
        kb = mla_ops.auto_key_block(B, H, T)
        assert kb % mla_ops.KEY_BLOCK == 0 and (4 * B * H * T * kb <= budget or kb == mla_ops.KEY_BLOCK)
    assert mla_ops.auto_key_block(1, 32, 1) == 262144 and mla_ops.auto_key_block(1, 2, 2048) == 512
    attn = mla_layers(kl_blocks)[0]
    x = mx.random.normal((1, 700, kl_blocks.args.hidden_size), key=mx.random.key(3))
    for prefix in (600, 699):  # a 100-token chunk, a decode step
        auto = layer_chunk(attn, x, prefix, None, None)
        small = layer_chunk(attn, x, prefix, None, 64)
        assert mx.abs(auto - small).max().item() <= 1e-5
