"""The MLA attention Metal kernels (metal_kernels/mla_decode.metal, mla_prefill.metal) against the pure-MLX
blockwise path of ``kimi_mlx.ops.mla_attention``, run on a Metal GPU or in the CPU emulator (small shapes: the
emulator runs every thread as a fiber); also over keys in segments (a paged cache's pages: one launch per segment,
merged by the kernels' log-sum-exps)."""

import mlx.core as mx
import numpy as np
import pytest
from metal_support import KernelBackend, assert_matches, kernels_fixture, mismatch, strict_kernels_fixture  # noqa: F401
from mlx_lm.models.mla import MultiLinear

from kimi_mlx import metal
from kimi_mlx.ops.mla_attention import LeftPaddedCausal, mla_attention
from kimi_mlx.ops.mla_attention_metal import mla_attention_metal, mla_latent_attention_metal

DECODE, PREFILL = "kimi_mla_decode", "kimi_mla_prefill"


def make_inputs(B, H, T, S, r, dr, dn, dv, dtype=mx.float32, pad=None, seed=0):
    """Queries, a latent cache, per-head embed_q / unembed_out and the mask: None, "causal", or left padding of
    ``pad[b]`` keys per row on top of causal as a bool [B, 1, T, S] mask."""
    rng = np.random.default_rng(seed)

    def arr(*shape, sd=1.0):
        return mx.array(rng.standard_normal(shape) * sd, mx.float32).astype(dtype)

    q_nope, q_pe = arr(B, H, T, dn), arr(B, H, T, dr)
    c, kr = arr(B, 1, S, r), arr(B, 1, S, dr)
    mx.random.seed(seed)
    embed_q, unembed_out = MultiLinear(dn, r, H), MultiLinear(r, dv, H)
    embed_q.weight = (embed_q.weight * 4).astype(dtype)  # scores of order 1-10: a peaked softmax
    unembed_out.weight = unembed_out.weight.astype(dtype)
    mask = None if T == 1 else "causal"
    if pad is not None:
        causal = mx.arange(S)[None, :] <= (S - T + mx.arange(T))[:, None]
        mask = (mx.arange(S)[None, None, None, :] >= mx.array(pad)[:, None, None, None]) & causal
    scale = (dn + dr) ** -0.5
    return (q_nope, q_pe, c, kr, embed_q, unembed_out, scale, mask)


CASES = {
    # name: (B, H, T, S, r, dr, dn, dv, pad)
    "decode-S-one-block": (1, 2, 1, 20, 64, 32, 32, 32, None),
    "decode-B2-padded-S-not-multiple-of-32": (2, 3, 1, 77, 64, 32, 32, 32, [0, 40]),
    "decode-K3-head-dims": (1, 2, 1, 45, 512, 64, 128, 128, None),
    "prefill-T5-causal": (1, 2, 5, 70, 64, 32, 32, 32, None),
    "prefill-B2-T3-left-padded": (2, 3, 3, 50, 64, 32, 32, 32, [0, 35]),
    "prefill-K3-head-dims": (1, 2, 3, 40, 512, 64, 128, 128, None),
}
KEY_BLOCK = 16  # the pure reference runs blockwise (S > KEY_BLOCK) with partial last blocks


@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_pure_blockwise_path(case, kernels):
    """float32 within 1e-5 of the pure blockwise path (absorbed and expanded) at S not a multiple of the kernel's
    32-key blocks, T > 1 causal chunks, left padding (whole padded key blocks), B > 1 and Kimi's real head dims."""
    B, H, T, S, r, dr, dn, dv, pad = CASES[case]
    args = make_inputs(B, H, T, S, r, dr, dn, dv, pad=pad)
    with kernels.active():
        got = mla_attention_metal(*args, simdgroups=2)
        mx.eval(got)
    assert kernels.launched == [DECODE if T == 1 else PREFILL]
    for absorbed in (True, False):
        with metal.disabled():
            ref = mla_attention(*args, key_block=KEY_BLOCK, absorbed=absorbed)
        assert got.shape == ref.shape == (B, H, T, dv)
        assert_matches(got, ref, f"{case} vs absorbed={absorbed}")
    kernels.assert_clean()


def _as_f32(args):
    q_nope, q_pe, c, kr, embed_q, unembed_out, scale, mask = args
    e, u = MultiLinear(1, 1, 1), MultiLinear(1, 1, 1)
    e.weight, u.weight = embed_q.weight.astype(mx.float32), unembed_out.weight.astype(mx.float32)
    return (*(x.astype(mx.float32) for x in (q_nope, q_pe, c, kr)), e, u, scale, mask)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("T", [1, 4])
def test_half_inputs_accumulate_in_float32(dtype, T, kernels):
    """bfloat16/float16 inputs: the kernel (float32 accumulation, output rounded once to the input dtype before
    unembed_out) is at least as close to the float32 computation on the same rounded inputs as the pure path in that
    dtype is, and within 2 ulp of the float32 path's latent output."""
    args = make_inputs(2, 2, T, 45, 64, 32, 32, 32, dtype=dtype, pad=[0, 33], seed=3)
    with kernels.active():
        got = mla_attention_metal(*args, simdgroups=2)
        mx.eval(got)
        q_lat = args[4](args[0]) * args[6]
        lat = mla_latent_attention_metal(q_lat, (args[1] * args[6]).astype(dtype), args[2], args[3], args[7],
                                         simdgroups=2)  # fmt: skip
    assert got.dtype == dtype
    with metal.disabled():
        ref32 = mla_attention(*_as_f32(args), key_block=KEY_BLOCK)
        pure_half = mla_attention(*args, key_block=KEY_BLOCK)
        lat32 = mla_attention(q_lat.astype(mx.float32), (args[1] * args[6]).astype(dtype).astype(mx.float32),
                              *(x.astype(mx.float32) for x in args[2:4]), lambda x, transpose=True: x,
                              lambda x: x, 1.0, args[7], key_block=KEY_BLOCK)  # fmt: skip
    e_kernel = mismatch(got.astype(mx.float32), ref32)["max_abs"]
    e_pure = mismatch(pure_half.astype(mx.float32), ref32)["max_abs"]
    assert e_kernel <= e_pure, f"kernel error {e_kernel:.3g} > pure {dtype} path's {e_pure:.3g}"
    assert_matches(lat, lat32.astype(dtype), "latent output")
    kernels.assert_clean()


@pytest.mark.parametrize("T", [1, 3])
def test_no_races_or_uninitialised_reads(T, strict_kernels):
    """Three schedules agree and no uninitialised threadgroup/local read is reported: decode with four SIMD-groups
    (one of them without keys) merging in threadgroup memory, prefill with a partial last threadgroup (T*H = 9 rows,
    4 per threadgroup) and left padding."""
    args = make_inputs(2, 3, T, 70, 64, 32, 32, 32, pad=[0, 37], seed=5)
    with metal.disabled():
        ref = mla_attention(*args, key_block=KEY_BLOCK)
    with strict_kernels.active():
        got = mla_attention_metal(*args, simdgroups=4)
        mx.eval(got)
    strict_kernels.assert_clean()
    assert_matches(got, ref)


def test_gradients_through_the_kernel_path(kernels):
    """mx.grad through mla_attention_metal (prefill kernel) gives the pure path's gradients for the queries, the
    latent cache and the embed_q / unembed_out weights."""
    q_nope, q_pe, c, kr, embed_q, unembed_out, scale, mask = make_inputs(1, 2, 3, 40, 64, 32, 32, 32, seed=7)
    wo = mx.array(np.random.default_rng(1).standard_normal((1, 2, 3, 32)), mx.float32)

    def loss(qn, qp, c, kr, we, wu, fn):
        embed_q.weight, unembed_out.weight = we, wu
        return (fn(qn, qp, c, kr, embed_q, unembed_out, scale, mask) * wo).sum()

    primals = (q_nope, q_pe, c, kr, embed_q.weight, unembed_out.weight)
    with metal.disabled():
        ref = mx.grad(lambda *a: loss(*a, lambda *b: mla_attention(*b, key_block=KEY_BLOCK)), argnums=tuple(range(6)))(
            *primals
        )
    with kernels.active():
        got = mx.grad(lambda *a: loss(*a, mla_attention_metal), argnums=tuple(range(6)))(*primals)
        mx.eval(got)
        assert kernels.launched == [PREFILL]
    for name, g, r in zip(("q_nope", "q_pe", "kv_latent", "k_pe", "embed_q", "unembed_out"), got, ref):
        assert_matches(g, r, f"d loss / d {name}")


def _split(x: mx.array, widths: list[int]) -> list[mx.array]:
    """``x [B, 1, S, d]`` as segments of ``widths`` positions (contiguous copies, as a paged cache's pages are)."""
    starts = np.cumsum([0, *widths])
    return [mx.contiguous(x[:, :, a:b]) for a, b in zip(starts[:-1], starts[1:])]


SEGMENT_CASES = {
    # name: (B, H, T, widths, pad): pad None = no padding (None / "causal"), else a LeftPaddedCausal batch
    "decode-4-segments": (1, 2, 1, [32, 13, 20, 12], None),
    "decode-B2-padding-covers-two-segments": (2, 3, 1, [16, 16, 30], [0, 40]),
    "prefill-T5-chunk-spans-the-last-two": (1, 2, 5, [40, 27, 3], None),
    "prefill-B2-T3-left-padded": (2, 2, 3, [20, 20, 10], [0, 35]),
}


@pytest.mark.parametrize("case", SEGMENT_CASES)
def test_segments_match_the_pure_path_over_the_whole_cache(case, kernels):
    """Keys in segments (widths not multiples of 32; a causal chunk whose first queries see none of the last
    segment; left padding hiding whole segments of a row): one launch per segment, merged by log-sum-exp, equals the
    pure path over the same keys in one array within 1e-5 (float32); ``mla_attention`` dispatches to it."""
    B, H, T, widths, pad = SEGMENT_CASES[case]
    S = sum(widths)
    q_nope, q_pe, c, kr, embed_q, unembed_out, scale, _ = make_inputs(B, H, T, S, 64, 32, 32, 32, seed=11)
    mask = (None if T == 1 else "causal") if pad is None else LeftPaddedCausal(mx.array(pad))
    args = (q_nope, q_pe, _split(c, widths), _split(kr, widths), embed_q, unembed_out, scale, mask)
    with metal.disabled():
        ref = mla_attention(q_nope, q_pe, c, kr, embed_q, unembed_out, scale, mask, key_block=KEY_BLOCK)
    with kernels.active():
        got = mla_attention(*args)
        mx.eval(got)
    assert kernels.launched == [DECODE if T == 1 else PREFILL] * len(widths)
    assert_matches(got, ref, case)
    kernels.assert_clean()


@pytest.mark.parametrize("T", [1, 3])
def test_log_sum_exp_output(T, kernels):
    """The kernels' second output is each row's log sum exp of its visible scores (from the scores computed in
    MLX, float64 on the host), -inf for a row that sees no key."""
    B, H, S = 2, 2, 37
    q_nope, q_pe, c, kr, embed_q, _, scale, _ = make_inputs(B, H, T, S, 64, 32, 32, 32, seed=13)
    q_lat, q_rot = embed_q(q_nope) * scale, q_pe * scale
    visible = mx.arange(S)[None, None, None, :] >= mx.array([0, 40])[:, None, None, None]  # row 1 sees nothing
    with kernels.active():
        _, lse = mla_latent_attention_metal(q_lat, q_rot, c, kr, visible, simdgroups=2, with_lse=True)
        mx.eval(lse)
    scores = np.array(q_lat @ c.swapaxes(-1, -2) + q_rot @ kr.swapaxes(-1, -2)).astype(np.float64)  # [B, H, T, S]
    want = np.log(np.exp(scores[0]).sum(-1))
    assert np.allclose(np.array(lse[0]), want, rtol=1e-5, atol=1e-5) and np.isneginf(np.array(lse[1])).all()
    kernels.assert_clean()


def test_segments_gradients_and_races(strict_kernels):
    """Segments under strict checks (no race or uninitialised read; decode with 4 SIMD-groups, one of them without
    keys in a short segment), and mx.grad through them equals the pure path's gradients for every segment."""
    q_nope, q_pe, c, kr, embed_q, unembed_out, scale, _ = make_inputs(1, 2, 1, 50, 64, 32, 32, 32, seed=17)
    widths = [32, 18]
    wo = mx.array(np.random.default_rng(2).standard_normal((1, 2, 1, 32)), mx.float32)

    def loss(qn, *kv, fn):
        return (fn(qn, q_pe, list(kv[:2]), list(kv[2:]), embed_q, unembed_out, scale, None) * wo).sum()

    primals = (q_nope, *_split(c, widths), *_split(kr, widths))
    with metal.disabled():
        ref = mx.grad(lambda *a: loss(*a, fn=lambda *b: mla_attention(*b, key_block=KEY_BLOCK)),
                      argnums=tuple(range(5)))(*primals)
    with strict_kernels.active():
        got = mx.grad(lambda *a: loss(*a, fn=lambda *b: mla_attention_metal(*b, simdgroups=4)),
                      argnums=tuple(range(5)))(*primals)
        mx.eval(got)
    strict_kernels.assert_clean()
    for name, g, r in zip(("q_nope", "c_kv 0", "c_kv 1", "k_pe 0", "k_pe 1"), got, ref):
        assert_matches(g, r, f"d loss / d {name}")


def test_bad_arguments_are_errors(kernels):
    q_nope, q_pe, c, kr, embed_q, unembed_out, scale, _ = make_inputs(1, 2, 2, 20, 64, 32, 32, 32)
    q_lat = embed_q(q_nope)
    with kernels.active():
        with pytest.raises(ValueError, match="do not fit"):
            mla_latent_attention_metal(q_lat, q_pe, c[:, :, :10], kr)
        with pytest.raises(ValueError, match="q_lat dtype mlx.core.int32 not supported"):
            mla_latent_attention_metal(q_lat.astype(mx.int32), q_pe, c, kr)
        with pytest.raises(ValueError, match="one query per row, got T=2"):
            mla_latent_attention_metal(q_lat, q_pe, c, kr, decode=True)
        with pytest.raises(ValueError, match=r"mla_prefill: simdgroups=33 asks for 1056 threads per threadgroup"):
            mla_latent_attention_metal(q_lat, q_pe, c, kr, simdgroups=33)
        with pytest.raises(ValueError, match="mask must be None, 'causal' or a bool array"):
            mla_latent_attention_metal(q_lat, q_pe, c, kr, "sliding")
    with metal.disabled(), pytest.raises(RuntimeError, match="not enabled"):
        mla_latent_attention_metal(q_lat, q_pe, c, kr)


def test_dispatch(kernels):
    """mla_attention launches the decode kernel for one query and the prefill kernel for absorbed-size chunks when
    kernels are enabled (results equal the pure path), and no kernel for the expanded form, inside
    ``metal.disabled()`` or (on a machine without Metal) outside ``kernels.active()``."""
    B, H, S = 2, 2, 40
    for T, want in ((1, [DECODE]), (3, [PREFILL])):
        args = make_inputs(B, H, T, S, 64, 32, 32, 32, pad=[0, 20], seed=T)
        with metal.disabled():
            ref = mla_attention(*args, key_block=KEY_BLOCK)
        kernels.launched.clear()
        with kernels.active():
            got = mla_attention(*args, key_block=KEY_BLOCK)
            mx.eval(got)
            assert kernels.launched == want
            mx.eval(mla_attention(*args, key_block=KEY_BLOCK, absorbed=False))
            with metal.disabled():
                mx.eval(mla_attention(*args, key_block=KEY_BLOCK))
            assert kernels.launched == want
        assert_matches(got, ref, f"T={T}")
    if kernels.name == "emulator":
        assert not metal.enabled()
