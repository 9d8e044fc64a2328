"""Blockwise MLA attention (ops/mla_attention.py) over the paged latent cache: equals the plain path (one
``scaled_dot_product_attention`` call over the whole cache expanded per head), bounds prefill memory (the cache grows
by pages, never by copying)."""

from contextlib import contextmanager

import mlx.core as mx
import pytest

import kimi_mlx.layers.mla as mla_layer
import kimi_mlx.ops.mla_attention as mla_ops
from kimi_mlx.cache import MLALatentCache
from kimi_mlx.models.kimi_linear import attention_mask
from kimi_mlx.ops.latent import concatenate, width
from kimi_mlx.ops.mla_paths import fused, segments


def mla_layers(model):
    return [layer.self_attn for layer in model.layers if not layer.is_linear]


def set_key_block(model, key_block: int) -> None:
    for attn in mla_layers(model):
        attn.key_block = key_block


def plain_attention(q_nope, q_pe, kv_latent, k_pe, embed_q, unembed_out, scale, mask=None, **_):
    """The reference: the cache's segments concatenated, expanded per head, one ``scaled_dot_product_attention``."""
    kv_latent, k_pe = (concatenate(segments(x), 2) for x in (kv_latent, k_pe))
    return fused(q_nope, q_pe, kv_latent, k_pe, embed_q, unembed_out, scale, mask, absorbed=False)


@contextmanager
def plain_layers():
    """The MLA layers attend by ``plain_attention`` inside the block."""
    blockwise = mla_layer.mla_attention
    mla_layer.mla_attention = plain_attention
    try:
        yield
    finally:
        mla_layer.mla_attention = blockwise


def layer_chunk(attn, x, prefix: int, left_padding, key_block: int, page_size: int = 4096) -> mx.array:
    """The layer's output for x[:, prefix:] after x[:, :prefix] went into a fresh latent cache of ``page_size``
    positions per page."""
    attn.key_block = key_block
    cache = MLALatentCache(None if left_padding is None else mx.array(left_padding))
    cache.page_size = page_size
    T = x.shape[1] - prefix
    if prefix:
        attn(x[:, :prefix], attention_mask(prefix, 0, cache.left_padding), cache)
    return attn(x[:, prefix:], attention_mask(T, prefix, cache.left_padding), cache)


FORMS = {  # name: (absorbed, queries per expanded tile)
    "absorbed": (True, mla_ops.QUERY_BLOCK),
    "expanded": (False, mla_ops.QUERY_BLOCK),
    "expanded-5-query-tiles": (False, 5),  # several query blocks, diagonal tiles across 16-key block ends
}


@pytest.mark.parametrize("form", FORMS)
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
def test_layer_blockwise_equals_plain(request, arch_name, prefix, T, left_padding, form, monkeypatch):
    """16-key blocks in one page, and in 24-position pages (blocks cut at page ends: 16 + 8 keys; chunks written
    across pages), equal the plain path over one page, in either form (expanded: in tiles of 128 or 5 queries)."""
    model = request.getfixturevalue(arch_name)
    attn = mla_layers(model)[0]
    absorbed, query_block = FORMS[form]
    monkeypatch.setattr(mla_ops, "absorbs", lambda *dims: absorbed)
    monkeypatch.setattr(mla_ops, "QUERY_BLOCK", query_block)
    B = 1 if left_padding is None else len(left_padding)
    x = mx.random.normal((B, prefix + T, model.args.hidden_size), key=mx.random.key(prefix * 1000 + T))
    try:
        with plain_layers():
            ref = layer_chunk(attn, x, prefix, left_padding, None)
        for page_size in (4096, 24):
            out = layer_chunk(attn, x, prefix, left_padding, 16, page_size)
            err = mx.abs(out - ref).max().item()
            assert err <= 1e-5 * max(1.0, mx.abs(ref).max().item()), (page_size, err)
    finally:
        attn.key_block = None


@pytest.fixture
def kl_blocks(kl_model):
    """The Kimi Linear fixture; its MLA layers get the default key block back afterwards."""
    yield kl_model
    set_key_block(kl_model, None)


def decode_vs_full(model, n: int, chunk: int, key_block: int, steps: int = 3) -> float:
    """Max |logit difference| / max |logit| between a full forward (the plain attention) over n + steps tokens and a
    prefill of n tokens in ``chunk``-token chunks followed by ``steps`` decode steps, with ``key_block``."""
    tokens = mx.random.randint(0, model.args.vocab_size, (1, n + steps), key=mx.random.key(n))
    with plain_layers():
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
    """Bytes a ``chunk``-token prefill chunk needs beyond weights, inputs and cache, after ``context`` tokens in a
    fresh ``model.make_cache()`` (no room set aside: the chunk's writes grow the cache as any caller's do).

    The first chunk is real; the MLA latent caches are then filled up to ``context`` with random latents (attention
    cost and memory depend only on their length) so long contexts are cheap to reach."""
    tokens = mx.random.randint(0, model.args.vocab_size, (1, 2 * chunk), key=mx.random.key(0))
    cache = model.make_cache(**kv)
    mx.eval(model(tokens[:, :chunk], cache=cache))
    fill = context - chunk
    for layer, c in zip(model.layers, cache):
        if layer.is_linear:
            c.advance(fill)
        else:
            shapes = (model.args.kv_lora_rank, model.args.qk_rope_head_dim)
            c.update_and_fetch(*(mx.random.normal((1, 1, fill, d)) for d in shapes))
    mx.eval([c.state for c in cache])
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(model(tokens[:, chunk:], cache=cache))
    return mx.get_peak_memory() - base


@pytest.mark.parametrize("kv", [{}, {"kv_bits": 8, "kv_group_size": 64}], ids=["float", "kv8"])
def test_prefill_memory_independent_of_context(kl_blocks, kv):
    """float32: a 512-token chunk after 32K tokens needs <= 1.1x the memory of one after 4K (both start a new page;
    scaled down from 2048-token chunks at 8K vs 64K, which bench/bench_mla_attention.py --memory measures: a minute
    on two cores). A cache that grew by copying itself would add its whole size (20 MiB at 32K) to the chunk; one
    that concatenated its pages for attention, likewise. The same with an 8-bit latent cache (its prefill
    dequantizes one key block at a time)."""
    set_key_block(kl_blocks, None)
    short = chunk_transient_memory(kl_blocks, 4096, 512, **kv)
    long = chunk_transient_memory(kl_blocks, 32768, 512, **kv)
    assert long <= 1.1 * short, (short / 2**20, long / 2**20)


@pytest.mark.parametrize("kv", [{}, {"kv_bits": 8, "kv_group_size": 64}], ids=["float", "kv8"])
def test_growth_adds_pages_and_keeps_the_others(kl_blocks, kv):
    """700 tokens in 100-token chunks into 256-position pages: each chunk leaves every page it did not write the
    same object (same buffer) as before and adds a page only when the last is full (3 pages at the end, the last
    holding 188 positions); the logits equal those of a cache whose one 1024-position page holds everything."""
    tokens = mx.random.randint(0, kl_blocks.args.vocab_size, (1, 700), key=mx.random.key(1))
    paged, whole = kl_blocks.make_cache(**kv), kl_blocks.make_cache(**kv)
    latent = [c for c in paged if isinstance(c, MLALatentCache)]
    for c in latent:
        c.page_size = 256
    for c in whole:
        c.page_size = 1024
    before = [list(c.pages) for c in latent]
    for start in range(0, 700, 100):
        chunk = tokens[:, start : start + 100]
        got, want = kl_blocks(chunk, cache=paged), kl_blocks(chunk, cache=whole)
        assert mx.abs(got - want).max().item() <= 1e-5
        for c, old in zip(latent, before):
            written = {start // 256, (start + 99) // 256}
            assert len(c.pages) == (start + 100 + 255) // 256
            assert all(c.pages[k] is page for k, page in enumerate(old) if k not in written)
            assert all(p.size == 256 for p in c.pages)
        before = [list(c.pages) for c in latent]
    assert [len(c.pages) for c in latent] == [3] * len(latent)
    assert all(width(c.fetch()[0][-1]) == 700 - 512 for c in latent)


def test_auto_key_block_bounds_scores_and_matches_small_blocks(kl_blocks):
    """``key_block=None`` (the layers' default): blocks of ``auto_key_block`` keys, whose float32 scores fit
    SCORE_BUDGET_BYTES whatever the context (absorbed decode: few large blocks of B x H x T x block scores; expanded
    prefill chunks: 512-key blocks in tiles of QUERY_BLOCK queries, also at K3's 96 heads); decode and prefill equal
    64-key blocks within 1e-5."""
    budget = mla_ops.SCORE_BUDGET_BYTES
    for B, H, T, absorbed in [(1, 32, 1, True), (1, 32, 128, True), (4, 2, 1, True), (1, 2, 100, True),
                              (1, 64, 4096, False), (1, 96, 2048, False), (1, 2, 40, False)]:
        kb = mla_ops.auto_key_block(B, H, T, absorbed)
        rows = T if absorbed else min(T, mla_ops.QUERY_BLOCK)
        assert kb % mla_ops.KEY_BLOCK == 0 and (4 * B * H * rows * kb <= budget or kb == mla_ops.KEY_BLOCK)
        assert absorbed or kb == mla_ops.KEY_BLOCK
    assert mla_ops.auto_key_block(1, 32, 1, True) == 262144 and mla_ops.auto_key_block(1, 2, 2048, False) == 512
    attn = mla_layers(kl_blocks)[0]
    x = mx.random.normal((1, 700, kl_blocks.args.hidden_size), key=mx.random.key(3))
    for prefix in (600, 699):  # a 100-token chunk, a decode step
        auto = layer_chunk(attn, x, prefix, None, None)
        small = layer_chunk(attn, x, prefix, None, 64)
        assert mx.abs(auto - small).max().item() <= 1e-5
