"""The split-K MLA decode (metal_kernels/mla_decode_split.metal + mla_decode_reduce.metal) against the pure-MLX
blockwise path of ``kimi_mlx.ops.mla_attention``, on a Metal GPU or in the CPU emulator: several splits per row,
splits a row cannot see at all (left padding, bool masks), partial head groups, key segments (pages) with split
boundaries inside them, half inputs, races and uninitialised reads under three schedules, the launch sizes at Kimi
Linear's and K3's dims (latent rank 512, rope 64, 32 and 96 heads) with the threadgroup memory the emulator
allocates, and where ``mla_attention`` switches between the one-pass and the split kernels."""

import mlx.core as mx
import numpy as np
import pytest
from metal_support import KernelBackend, assert_matches, kernels_fixture, mismatch, strict_kernels_fixture  # noqa: F401
from test_metal_limits import K3, KL, _run_narrow, narrow_fixture  # noqa: F401  (fixture)
from test_metal_mla_attention import KEY_BLOCK, _as_f32, _split, make_inputs

from kimi_mlx import metal
from kimi_mlx.ops.mla_attention import LeftPaddedCausal, mla_attention
from kimi_mlx.ops.mla_attention_metal import (
    DEFAULT_SIMDGROUPS,
    decode_splits,
    mla_attention_metal,
    mla_latent_attention_split,
    split_keys_per_tile,
    split_threadgroup_bytes,
)

SPLIT, REDUCE, ONE_PASS = "kimi_mla_decode_split", "kimi_mla_decode_reduce", "kimi_mla_decode"

CASES = {
    # name: (B, H, S, widths, pad, splits, simdgroups, keys_per_tile): widths None = one array
    "one-split": (1, 2, 45, None, None, 1, 1, 32),
    "7-splits-partial-tiles": (1, 3, 77, None, None, 7, 1, 8),
    "B2-padding-hides-the-first-splits": (2, 3, 77, None, [0, 60], 9, 2, 4),
    "a-split-per-key": (1, 2, 20, None, [3], 20, 1, 1),
    "tiles-of-2": (1, 2, 37, None, [5], 3, 1, 2),
    "pages-split-inside-each": (1, 4, 90, [40, 37, 13], None, 6, 2, 8),
    "B2-pages-padding-covers-a-page": (2, 2, 80, [32, 32, 16], [0, 40], 5, 1, 16),
}


def _args(B, H, S, widths, pad, dtype=mx.float32, r=64, dr=32, dn=32, seed=0):
    """make_inputs for one decode query (mask: None, or a LeftPaddedCausal batch) with the keys as one array or as
    segments of ``widths``; also the same inputs with the keys in one array (the reference's)."""
    q_nope, q_pe, c, kr, embed_q, unembed_out, scale, _ = make_inputs(B, H, 1, S, r, dr, dn, dn, dtype=dtype, seed=seed)
    mask = None if pad is None else LeftPaddedCausal(mx.array(pad))
    whole = (q_nope, q_pe, c, kr, embed_q, unembed_out, scale, mask)
    if widths is None:
        return whole, whole
    return (q_nope, q_pe, _split(c, widths), _split(kr, widths), embed_q, unembed_out, scale, mask), whole


@pytest.mark.parametrize("case", CASES)
def test_split_decode_matches_pure_path(case, kernels):
    """float32 within 1e-5 of the pure blockwise path (absorbed and expanded): one to one-per-key splits, every tile
    size (1 to 32 keys: the reduce-scatter of the scores at every depth) with tiles shorter than ``keys_per_tile`` at
    a split's end, splits a padded row cannot see (m = -inf, l = 0 partials), heads not a multiple of a
    threadgroup's, and pages whose splits end inside them (one split launch per page, one reduce over all their
    partials). The kernels give the latent output; ``unembed_out`` maps it as ``mla_attention_metal`` does."""
    B, H, S, widths, pad, splits, sg, tk = CASES[case]
    args, whole = _args(B, H, S, widths, pad)
    q_nope, q_pe, cs, krs, embed_q, unembed_out, scale, mask = args
    with kernels.active():
        got = unembed_out(mla_latent_attention_split(embed_q(q_nope) * scale, q_pe * scale, cs, krs, mask,
                                                     splits=splits, simdgroups=sg, keys_per_tile=tk))  # fmt: skip
        mx.eval(got)
    assert kernels.launched == [SPLIT] * len(widths or [S]) + [REDUCE]
    for absorbed in (True, False):
        with metal.disabled():
            ref = mla_attention(*whole, key_block=KEY_BLOCK, absorbed=absorbed)
        assert_matches(got, ref, f"{case} vs absorbed={absorbed}")
    kernels.assert_clean()


def test_bool_mask_rows_seeing_one_key_and_lse(kernels):
    """A bool [B, 1, 1, S] mask (the form ``block_mask`` passes) where row 0 sees scattered keys and row 1 only its
    last key (every other split of row 1 is empty): output equals the pure path, and the log-sum-exp output equals
    the host's float64 log sum exp of the visible scores."""
    B, H, S = 2, 2, 70
    q_nope, q_pe, c, kr, embed_q, unembed_out, scale, _ = make_inputs(B, H, 1, S, 64, 32, 32, 32, seed=3)
    vis = np.random.default_rng(4).random((B, 1, 1, S)) < 0.3
    vis[1] = False
    vis[:, ..., S - 1] = True
    mask = mx.array(vis)
    with metal.disabled():
        ref = mla_attention(q_nope, q_pe, c, kr, embed_q, unembed_out, scale, mask, key_block=KEY_BLOCK)
    q_lat, q_rot = embed_q(q_nope) * scale, q_pe * scale
    with kernels.active():
        got = mla_attention_metal(q_nope, q_pe, c, kr, embed_q, unembed_out, scale, mask, splits=5, simdgroups=1)
        _, lse = mla_latent_attention_split(q_lat, q_rot, c, kr, mask, splits=5, with_lse=True)
        mx.eval(got, lse)
    assert_matches(got, ref)
    scores = np.array(q_lat @ c.swapaxes(-1, -2) + q_rot @ kr.swapaxes(-1, -2)).astype(np.float64)  # [B, H, 1, S]
    want = np.log(np.where(vis, np.exp(scores), 0.0).sum(-1))
    assert np.allclose(np.array(lse), want, rtol=1e-5, atol=1e-5)
    kernels.assert_clean()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_half_inputs_accumulate_in_float32(dtype, kernels):
    """bfloat16/float16 queries and cache (tile in the cache's dtype, float32 partials): at least as close to the
    float32 computation on the same rounded inputs as the pure path in that dtype, and the latent output within
    2 ulp of the float32 pure latent output."""
    args, _ = _args(2, 2, 61, [30, 31], [0, 33], dtype=dtype, seed=5)
    q_nope, q_pe, cs, krs, embed_q, unembed_out, scale, mask = args
    q_lat, q_rot = embed_q(q_nope) * scale, (q_pe * scale).astype(dtype)
    with kernels.active():
        got = mla_attention_metal(*args, splits=4)
        lat = mla_latent_attention_split(q_lat, q_rot, cs, krs, mask, splits=4)
        mx.eval(got, lat)
    assert got.dtype == lat.dtype == dtype
    c, kr = mx.concatenate(cs, axis=2), mx.concatenate(krs, axis=2)
    whole = (q_nope, q_pe, c, kr, embed_q, unembed_out, scale, mask)
    with metal.disabled():
        ref32 = mla_attention(*_as_f32(whole), key_block=KEY_BLOCK)
        pure_half = mla_attention(*whole, key_block=KEY_BLOCK)
        lat32 = mla_attention(q_lat.astype(mx.float32), q_rot.astype(mx.float32), c.astype(mx.float32),
                              kr.astype(mx.float32), lambda x, transpose=True: x, lambda x: x, 1.0, mask,
                              key_block=KEY_BLOCK)  # fmt: skip
    e_kernel = mismatch(got.astype(mx.float32), ref32)["max_abs"]
    e_pure = mismatch(pure_half.astype(mx.float32), ref32)["max_abs"]
    assert e_kernel <= e_pure, f"kernel error {e_kernel:.3g} > pure {dtype} path's {e_pure:.3g}"
    assert_matches(lat, lat32.astype(dtype), "latent output")
    kernels.assert_clean()


def _identity(x, transpose=True):
    return x


def test_no_races_or_uninitialised_reads(strict_kernels):
    """Three schedules agree and no uninitialised threadgroup / local read: 2 SIMD-groups share each staged tile of 8
    keys (3 tiles per split of 19 keys, the last one short; in the second head group of 5 heads one SIMD-group has
    1 head, the other none but still loads tiles, so it runs ahead to the next tile where a barrier is missing), a
    padded row, two pages."""
    args, _ = _args(2, 5, 75, [41, 34], [0, 50], seed=7)
    q_nope, q_pe, cs, krs, embed_q, _, scale, mask = args
    q_lat, q_rot = embed_q(q_nope) * scale, q_pe * scale
    with metal.disabled():
        ref = mla_attention(q_lat, q_rot, mx.concatenate(cs, axis=2), mx.concatenate(krs, axis=2), _identity,
                            _identity, 1.0, mask, key_block=KEY_BLOCK)  # fmt: skip
    with strict_kernels.active():
        got = mla_latent_attention_split(q_lat, q_rot, cs, krs, mask, splits=4, simdgroups=2, keys_per_tile=8)
        mx.eval(got)
    strict_kernels.assert_clean()
    assert strict_kernels.threadgroups == [(64, 1, 1)] * 2 + [(128, 1, 1)]
    assert_matches(got, ref)


def test_gradients_through_the_split_path(kernels):
    """mx.grad through the split decode gives the pure path's gradients for the query and every page."""
    args, whole = _args(1, 2, 50, [32, 18], None, seed=9)
    q_nope, q_pe, cs, krs, embed_q, unembed_out, scale, _ = args
    wo = mx.array(np.random.default_rng(2).standard_normal((1, 2, 1, 32)), mx.float32)

    def loss(qn, *kv, fn):
        return (fn(qn, q_pe, list(kv[:2]), list(kv[2:]), embed_q, unembed_out, scale, None) * wo).sum()

    primals = (q_nope, *cs, *krs)
    with metal.disabled():
        ref = mx.grad(lambda *a: loss(*a, fn=lambda *b: mla_attention(*b, key_block=KEY_BLOCK)),
                      argnums=tuple(range(5)))(*primals)  # fmt: skip
    with kernels.active():
        got = mx.grad(lambda *a: loss(*a, fn=lambda *b: mla_attention_metal(*b, splits=3)),
                      argnums=tuple(range(5)))(*primals)  # fmt: skip
        mx.eval(got)
    assert SPLIT in kernels.launched
    for name, g, r in zip(("q_nope", "c_kv 0", "c_kv 1", "k_pe 0", "k_pe 1"), got, ref):
        assert_matches(g, r, f"d loss / d {name}")


# -- real sizes, launch limits, dispatch ----------------------------------------------------------------------


def test_launch_sizes_by_hand():
    """The launch arithmetic at latent rank 512, rope 64: a bfloat16 tile of 8 keys is 8 x 576 x 2 = 9,216 bytes
    (float32: 4 keys, the same bytes), 32 tile keys would be 36,864 (past 32 KB); 8 SIMD-groups of 2 heads = 256
    threads, 16 heads per threadgroup: 2 head groups at 32 heads, 6 at 96."""
    assert split_keys_per_tile(512, 64, 2) == 8 and split_keys_per_tile(512, 64, 4) == 4
    assert split_threadgroup_bytes(8, 512, 64, 2) == split_threadgroup_bytes(4, 512, 64, 4) == 9216
    assert split_threadgroup_bytes(16, 512, 64, 4) == 36864 > metal.MAX_THREADGROUP_MEMORY
    assert 32 * DEFAULT_SIMDGROUPS == 256 <= metal.MAX_THREADS_PER_THREADGROUP
    assert split_keys_per_tile(64, 32, 4) == 32  # the small test shapes: a full SIMD-group of keys per tile


@pytest.mark.parametrize(
    ("B", "H", "S", "want"),
    [
        (1, 32, 4095, 0),  # 15 splits x 2 head groups < 32 threadgroups of mla_decode
        (1, 32, 4096, 16),
        (1, 32, 32768, 64),  # 2 x 64 = 128 threadgroups = 4 per core of 32
        (1, 96, 4096, 16),  # 6 head groups
        (1, 96, 32768, 22),  # ceil(128 / 6)
        (4, 32, 32768, 16),  # 8 head groups
        (8, 32, 32768, 16),  # as many threadgroups as mla_decode's 256, each latent row read twice, not 32 times
        (8, 32, 4095, 0),  # 15 splits x 16 groups < 256
        (1, 2, 511, 0),  # one head group, one split
        (1, 2, 512, 2),
    ],
)
def test_decode_splits(B, H, S, want):
    assert decode_splits(B, H, S) == want
    assert decode_splits(B, H, S, gpu_cores=80) >= want


@pytest.mark.parametrize(
    ("cfg", "S", "widths", "pad", "splits"),
    [(KL, 4096 + 37, [4096, 37], None, None), (K3, 700, [300, 400], [13], 5)],
    ids=["kl-32-heads-auto-splits", "k3-96-heads"],
)
def test_real_sizes(cfg, S, widths, pad, splits, kernels):
    """At latent rank 512, rope 64, dn = dv = 128, float32: Kimi Linear's 32 heads over a full 4096-key page plus 37
    keys (``mla_attention`` picks the split decode by itself: 16 splits of 259 keys, the second page one split) and
    K3's 96 heads over two pages with left padding; both equal the pure path, every threadgroup has 256 threads and
    the emulator allocates exactly ``split_threadgroup_bytes`` (9,216)."""
    H = cfg.num_attention_heads
    args, whole = _args(1, H, S, widths, pad, r=cfg.kv_lora_rank, dr=cfg.qk_rope_head_dim, dn=cfg.qk_nope_head_dim)
    with kernels.active():
        got = mla_attention(*args) if splits is None else mla_attention_metal(*args, splits=splits)
        mx.eval(got)
    with metal.disabled():
        ref = mla_attention(*whole, key_block=256)
    assert_matches(got, ref)
    assert kernels.launched == [SPLIT, SPLIT, REDUCE]
    assert kernels.threadgroups == [(256, 1, 1)] * 2 + [(128, 1, 1)]
    if kernels.name == "emulator":
        split_bytes = [r.stats["threadgroup_bytes"] for n, r in kernels.results if n == SPLIT]
        assert split_bytes == [split_threadgroup_bytes(4, 512, 64, 4)] * 2 == [9216] * 2
    kernels.assert_clean()


def test_indices_past_uint(narrow):
    """With a 16-bit ``uint`` in the bodies (``metal_support.NARROW_UINT``): c_kv [B, S, 512] = 5 * 40 * 512 =
    102,400 and the partials [B, H, splits, 512] = 5 * 32 * 4 * 512 = 327,680 elements, both past 2^16, equal the
    pure path (offsets in 64 bits in both kernels)."""
    args, _ = _args(5, KL.num_attention_heads, 40, None, [0, 3, 0, 9, 1], r=512, dr=64, dn=128)
    _run_narrow(narrow, "mla_decode_reduce", lambda: (mla_attention_metal(*args, splits=4),),
                lambda: (mla_attention(*args, key_block=16),))  # fmt: skip
    assert "kimi_mla_decode_split" in narrow.launched


def test_short_caches_keep_the_one_pass_kernel(kernels):
    """``mla_attention`` launches mla_decode where ``decode_splits`` is 0 (511 keys, 2 heads) and the split kernels
    from 512 keys (2 splits), both equal to the pure path."""
    for S, want in ((511, [ONE_PASS]), (512, [SPLIT, REDUCE])):
        args, _ = _args(1, 2, S, None, [7], seed=S)
        with metal.disabled():
            ref = mla_attention(*args, key_block=KEY_BLOCK)
        kernels.launched.clear()
        with kernels.active():
            got = mla_attention(*args, key_block=KEY_BLOCK)
            mx.eval(got)
        assert kernels.launched == want, S
        assert_matches(got, ref, f"S={S}")
    kernels.assert_clean()


def test_bad_arguments_are_errors(kernels):
    args, _ = _args(1, 2, 20, None, None)
    q_nope, q_pe, c, kr, embed_q, *_ = args
    q_lat = embed_q(q_nope)
    with kernels.active():
        with pytest.raises(ValueError, match="one query per row, got T=2"):
            mla_latent_attention_split(mx.concatenate([q_lat] * 2, axis=2), mx.concatenate([q_pe] * 2, axis=2), c, kr,
                                       splits=2)  # fmt: skip
        with pytest.raises(ValueError, match="do not fit"):
            mla_latent_attention_split(q_lat, q_pe, [c[:, :, :10], c[:, :, 10:]], [kr], splits=2)
        with pytest.raises(ValueError, match="do not fit"):
            mla_latent_attention_split(q_lat, q_pe, [c[:, :, :10], c[:, :, 10:]], [kr[:, :, :10]], splits=2)
        with pytest.raises(ValueError, match="splits must be >= 1"):
            mla_latent_attention_split(q_lat, q_pe, c, kr, splits=0)
        for tk in (64, 12):
            with pytest.raises(ValueError, match="keys_per_tile must be a power of two up to 32"):
                mla_latent_attention_split(q_lat, q_pe, c, kr, splits=2, keys_per_tile=tk)
    wide, _ = _args(1, 20, 20, None, None)
    with kernels.active():
        with pytest.raises(ValueError, match=r"mla_decode_split: simdgroups=17.* 544 threads"):
            mla_latent_attention_split(wide[4](wide[0]), wide[1], wide[2], wide[3], splits=2, simdgroups=17,
                                       heads_per_simdgroup=1)  # fmt: skip
    real, _ = _args(1, 2, 20, None, None, r=512, dr=64, dn=128)
    too_big = r"mla_decode_split: .*keys_per_tile=16 asks for 36864 bytes"
    with kernels.active(), pytest.raises(ValueError, match=too_big):
        mla_latent_attention_split(real[4](real[0]), real[1], real[2], real[3], splits=2, keys_per_tile=16)


@pytest.mark.parametrize("fixture", ["kl_model", "k3_model"])
def test_model_decode_through_the_split_kernels(fixture, kernels, request, monkeypatch):
    """The tiny Kimi Linear and K3 reference checkpoints with every decode step split 3 ways (``decode_splits``
    patched: their caches are far shorter than the switch), including a left-padded batch's decode: the same logits
    as the pure forward (``test_metal_model``'s calls and tolerance)."""
    from test_metal_model import TOL, _forward

    import kimi_mlx.ops.mla_attention_metal as mla_metal

    model = request.getfixturevalue(fixture)
    monkeypatch.setattr(mla_metal, "decode_splits", lambda B, H, S, **kw: 3)
    with metal.disabled():
        ref = _forward(model)
    with kernels.active():
        got = _forward(model)
    assert kernels.launched.count(SPLIT) >= 2 and ONE_PASS not in kernels.launched
    for name, g, r in zip(("prefill", "cached prefill", "decode", "ragged prefill", "ragged decode"), got, ref):
        err = float(mx.abs(g - r).max())
        assert err <= TOL, f"{fixture} {name}: max |logit difference| {err:.3g} > {TOL}"
    kernels.assert_clean()
