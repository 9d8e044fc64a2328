"""Launch limits of the Metal kernels at the real model sizes, on a Metal GPU or in the CPU emulator.

- Threads per threadgroup and threadgroup memory: every dispatch caps its settings by what its kernel needs and
  refuses, before launching, a threadgroup above ``kimi_mlx.metal.MAX_THREADS_PER_THREADGROUP`` threads or above
  ``MAX_THREADGROUP_MEMORY`` bytes (tests call the dispatch functions with settings past the limits). The threadgroup
  memory formulas equal what the emulator allocates, and every emulated launch runs under both limits
  (``metal_support.LIMITS``), at Kimi Linear's and K3's dims (``../shared/fixtures/configs``): latent rank 512, rope
  64, 32 and 96 heads, KDA heads of 128, K3's 7168-wide residual with 8 AttnRes snapshots, at the largest SIMD-group
  counts the caps allow.
- 64-bit indices: a buffer of 2^32 elements cannot be allocated here, so the kernels whose bodies use ``uint`` run
  with it narrowed to 16 bits (``metal_support.NARROW_UINT``) on buffers of more than 2^16 elements, where a uint
  index wraps; they must still equal the pure path. That executes the index arithmetic at the scaled-down wrap
  point; it does not execute a real 2^32-element launch (nor int arithmetic, which the kernels keep to positions
  along one axis).
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import SHARED
from metal_support import KernelBackend, assert_matches, kernels_fixture  # noqa: F401  (fixture)
from test_metal_attn_res import EPS
from test_metal_attn_res import make_inputs as mix_inputs
from test_metal_ggml import blocks_for
from test_metal_kda_chunked import inputs as chunked_inputs
from test_metal_kda_recurrent import make_inputs as recurrent_inputs
from test_metal_mla_attention import make_inputs as mla_inputs

from kimi_mlx import metal
from kimi_mlx.config import KimiConfig
from kimi_mlx.ops.attn_res import attn_res_mix, attn_res_mix_metal, threadgroup_bytes
from kimi_mlx.ops.ggml.dequant import dequantize
from kimi_mlx.ops.ggml.metal import matvec_metal
from kimi_mlx.ops.kda import kda_gated
from kimi_mlx.ops.kda_chunked import kda_chunked
from kimi_mlx.ops.kda_chunked_metal import kda_chunked_metal, prep_threadgroup_bytes
from kimi_mlx.ops.kda_recurrent_metal import kda_recurrent_metal
from kimi_mlx.ops.mla_attention import mla_attention
from kimi_mlx.ops.mla_attention_metal import decode_threadgroup_bytes, mla_attention_metal

CONFIGS = {name: KimiConfig.from_hf(json.loads((SHARED / "fixtures" / "configs" / f).read_text()))
           for name, f in (("kimi_linear", "kimi-linear-48b-a3b-instruct.json"), ("k3", "kimi-k3.json"))}  # fmt: skip
KL, K3 = CONFIGS["kimi_linear"], CONFIGS["k3"]
MOST_SIMDGROUPS = metal.MAX_THREADS_PER_THREADGROUP // 32


def _mla(cfg, B, T, S, heads=None, seed=0):
    """MLA inputs at ``cfg``'s latent rank, rope and head dims (``heads`` defaults to the config's)."""
    H = heads or cfg.num_attention_heads
    return mla_inputs(B, H, T, S, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim,
                      seed=seed)  # fmt: skip


def _launched_bytes(kernels, name) -> list[int]:
    """Threadgroup bytes the emulator allocated in each launch of kernel ``name`` (``kimi_<file stem>``)."""
    return [r.stats["threadgroup_bytes"] for n, r in kernels.results if n == name]


# -- threadgroup memory and threads at the real sizes -----------------------------------------------------------


def test_config_dims():
    """The real dims these tests run at (a config change shows here first)."""
    assert (KL.kv_lora_rank, KL.qk_rope_head_dim, KL.num_attention_heads, KL.kda_head_dim) == (512, 64, 32, 128)
    assert (K3.kv_lora_rank, K3.qk_rope_head_dim, K3.num_attention_heads, K3.kda_num_heads) == (512, 64, 96, 96)
    assert (K3.hidden_size, -(-K3.num_hidden_layers // K3.attn_res_block_size)) == (7168, 8)


@pytest.mark.parametrize(
    ("cfg", "simdgroups", "S"), [(KL, 15, 15 * 32 + 7), (K3, None, 70)], ids=["kl-15", "k3-default"]
)
def test_mla_decode_at_real_sizes(cfg, simdgroups, S, kernels):
    """mla_decode at latent rank 512 with the most SIMD-groups its merge buffers allow (15: 30840 bytes, every one
    with keys) and with the default (8) at K3's 96 heads equals the pure blockwise path; the emulator allocates
    exactly ``decode_threadgroup_bytes``."""
    args = _mla(cfg, 1, 1, S)
    with kernels.active():
        got = mla_attention_metal(*args, simdgroups=simdgroups)
        mx.eval(got)
    with metal.disabled():
        ref = mla_attention(*args, key_block=256)
    assert_matches(got, ref)
    sg = simdgroups or 8
    assert kernels.threadgroups == [(32 * sg, 1, 1)]
    if kernels.name == "emulator":
        assert _launched_bytes(kernels, "kimi_mla_decode") == [decode_threadgroup_bytes(sg, 512)]
    kernels.assert_clean()


@pytest.mark.parametrize("cfg", [KL, K3], ids=["kl", "k3"])
def test_mla_prefill_at_real_sizes(cfg, kernels):
    """mla_prefill with the most SIMD-groups the thread limit allows (16) at 32 and 96 heads, rank 512."""
    args = _mla(cfg, 1, 3, 40)
    with kernels.active():
        got = mla_attention_metal(*args, simdgroups=MOST_SIMDGROUPS)
        mx.eval(got)
    with metal.disabled():
        ref = mla_attention(*args, key_block=16)
    assert_matches(got, ref)
    assert kernels.threadgroups == [(metal.MAX_THREADS_PER_THREADGROUP, 1, 1)]
    kernels.assert_clean()


def test_mla_default_simdgroups_fit_any_rank(kernels):
    """At a latent rank whose merge buffers for 8 SIMD-groups would pass 32 KB (2048: 65,600 bytes) the default
    takes as many as fit (3: 24,600 bytes) and the result equals the pure path."""
    args = mla_inputs(1, 2, 1, 70, 2048, 64, 32, 32)
    with kernels.active():
        got = mla_attention_metal(*args)
        mx.eval(got)
    with metal.disabled():
        ref = mla_attention(*args, key_block=16)
    assert_matches(got, ref)
    assert kernels.threadgroups == [(96, 1, 1)]
    if kernels.name == "emulator":
        assert _launched_bytes(kernels, "kimi_mla_decode") == [decode_threadgroup_bytes(3, 2048)] == [24600]
    kernels.assert_clean()


def test_kda_kernels_at_real_head_dims(kernels):
    """Dk = Dv = 128: the chunked scan with simdgroups 32 capped at the 16 tiles of Dv (512 threads), the prep
    kernel at C = 32 with 4 SIMD-groups and slabs of 32 channels (``prep_threadgroup_bytes``: 27,776 bytes), the
    recurrent kernel with 16 rows per threadgroup (512 threads)."""
    args = chunked_inputs(1, 1, 40, 2, 128, 128, pad=(3,))
    rargs, rkw = recurrent_inputs(1, 3, 2, 128, 128, mx.float32, K3.kda_gate_lower_bound, ragged=True)
    with kernels.active():
        got = kda_chunked_metal(*args, chunk_size=32, simdgroups=32)
        rgot = kda_recurrent_metal(*rargs, **rkw, rows_per_group=MOST_SIMDGROUPS)
        mx.eval(got, rgot)
    with metal.disabled():
        ref = kda_chunked(*args, chunk_size=32)
        rref = kda_gated(*rargs, **rkw)
    for g, r, what in zip((*got, *rgot), (*ref, *rref), ("chunked o", "chunked state", "recurrent o", "state")):
        assert_matches(g, r, what)
    assert kernels.threadgroups == [(128, 1, 1), (32, 16, 1), (32, 16, 1)]
    if kernels.name == "emulator":
        assert _launched_bytes(kernels, "kimi_kda_chunked_prep") == [prep_threadgroup_bytes(32, 32)] == [27776]
        assert (
            _launched_bytes(kernels, "kimi_kda_chunked_scan") == _launched_bytes(kernels, "kimi_kda_recurrent") == [0]
        )
    kernels.assert_clean()


def test_attn_res_at_k3_width(kernels):
    """K3's AttnRes: 8 snapshots of a 7168-wide residual with 512 threads per row (the thread limit) and with the
    default 256 threads, 2 rows per threadgroup; the reduction buffer is ``threadgroup_bytes``."""
    blocks, scales, partial, w_eff = mix_inputs(8, 1, 3, K3.hidden_size, mx.float32)
    with metal.disabled():
        ref = attn_res_mix(blocks, scales, partial, w_eff, EPS)
    with kernels.active():
        for threads, rows in ((512, 1), (None, 2)):
            got = attn_res_mix_metal(blocks, scales, partial, w_eff, EPS, threads=threads, rows_per_group=rows)
            mx.eval(got)
            assert_matches(got, ref, f"threads={threads}, rows_per_group={rows}")
    assert kernels.threadgroups == [(512, 1, 1), (256, 2, 1)]
    if kernels.name == "emulator":
        assert (
            _launched_bytes(kernels, "kimi_attn_res_mix")
            == [threadgroup_bytes(8, 512, 1), threadgroup_bytes(8, 256, 2)]
            == [640, 640]
        )
    kernels.assert_clean()


@pytest.mark.parametrize("cfg", [KL, K3], ids=["kl", "k3"])
def test_kda_chunked_prep_every_head(cfg, kernels):
    """The chunked prefill's launch at full width: all 32 (Kimi Linear) / 96 (K3) KDA heads of 128, one chunk of 16
    (the default chunk) and a partial one: prep grid (128, 2, H), threadgroup (128, 1, 1) with 29,248 bytes (one
    slab of 128 channels), every output element written (the emulator's unwritten-output check) and equal to the
    pure path."""
    H, D = cfg.kda_num_heads, cfg.kda_head_dim
    args = chunked_inputs(15, 1, 21, H, D, D, pad=(2,))
    with kernels.active():
        got = kda_chunked_metal(*args, chunk_size=16)
        mx.eval(got)
    with metal.disabled():
        ref = kda_chunked(*args, chunk_size=16)
    assert_matches(got[0], ref[0], "o")
    assert_matches(got[1], ref[1], "state")
    assert kernels.grids[0] == (128, 2, H) and kernels.threadgroups[0] == (128, 1, 1)
    if kernels.name == "emulator":
        assert _launched_bytes(kernels, "kimi_kda_chunked_prep") == [prep_threadgroup_bytes(16, 128)] == [29248]
    kernels.assert_clean()


def test_settings_above_what_a_kernel_needs_are_capped(kernels):
    """More SIMD-groups / rows / threads than a kernel has work for are capped (MLX checks the uncapped threadgroup
    against the pipeline's limit): the launches ask for what the grid holds and equal the pure paths."""
    blocks, scales, partial, w_eff = mix_inputs(2, 1, 1, 64, mx.float32)
    cargs = chunked_inputs(2, 1, 9, 1, 32, 32)
    blocks_np = blocks_for("IQ4_NL")[:5]
    x = mx.array(np.random.default_rng(0).standard_normal((1, blocks_np.shape[1] // 18 * 32)), mx.float32)
    with kernels.active():
        mix = attn_res_mix_metal(blocks, scales, partial, w_eff, EPS, threads=512, rows_per_group=8)
        chk = kda_chunked_metal(*cargs, chunk_size=8, simdgroups=64, prep_simdgroups=64)
        y = matvec_metal(x, mx.array(blocks_np), "IQ4_NL", rows_per_threadgroup=64)
        mx.eval(mix, chk, y)
    assert kernels.threadgroups == [(64, 1, 1), (256, 1, 1), (32, 4, 1), (32, 5, 1)]
    with metal.disabled():
        assert_matches(mix, attn_res_mix(blocks, scales, partial, w_eff, EPS), "attn_res_mix")
        for g, r in zip(chk, kda_chunked(*cargs, chunk_size=8)):
            assert_matches(g, r, "kda_chunked")
        assert_matches(y, x @ dequantize(mx.array(blocks_np), "IQ4_NL").T, "ggml_matvec")
    kernels.assert_clean()


# -- refusals ---------------------------------------------------------------------------------------------------

MLA_DECODE = _mla(KL, 1, 1, 20)
MLA_PREFILL = _mla(KL, 1, 2, 20)
MIX = mix_inputs(2, 1, 4, 256, mx.float32)
MIX_DEEP = mix_inputs(511, 1, 2, 256, mx.float32)
RECURRENT = recurrent_inputs(1, 1, 1, 128, 128, mx.float32, None, ragged=False)
CHUNKED = chunked_inputs(1, 1, 9, 1, 32, 256)
CHUNKED_128 = chunked_inputs(1, 1, 40, 1, 128, 128)
GGML = blocks_for("IQ4_NL")
X = mx.zeros((1, GGML.shape[1] // 18 * 32), mx.float32)

REFUSED = {
    # name: (call, message)
    "mla_decode-memory": (
        lambda: mla_attention_metal(*MLA_DECODE, simdgroups=16),
        r"mla_decode: simdgroups=16 asks for 32896 bytes of threadgroup memory, above the limit of "
        r"32768 bytes \(Metal's limit\); at most 15 SIMD-groups at kv_lora_rank 512",
    ),
    "mla_decode-threads": (
        lambda: mla_attention_metal(*MLA_DECODE, simdgroups=17),
        r"mla_decode: simdgroups=17 asks for 544 threads per threadgroup, above the limit of 512",
    ),
    "mla_prefill-threads": (
        lambda: mla_attention_metal(*MLA_PREFILL, simdgroups=17),
        r"mla_prefill: simdgroups=17 asks for 544 threads .* 512 .*; at most 16 SIMD-groups",
    ),
    "mla-zero": (lambda: mla_attention_metal(*MLA_PREFILL, simdgroups=0), r"simdgroups must be >= 1, got 0"),
    "attn_res_mix-threads": (
        lambda: attn_res_mix_metal(*MIX, EPS, threads=256, rows_per_group=3),
        r"attn_res_mix: threads=256, rows_per_group=3 asks for 768 threads per threadgroup",
    ),
    "attn_res_mix-memory": (
        lambda: attn_res_mix_metal(*MIX_DEEP, EPS, threads=256, rows_per_group=2),
        r"attn_res_mix: threads=256, rows_per_group=2 asks for 32832 bytes of threadgroup memory, "
        r"above the limit of 32768 bytes .*K=511",
    ),
    "kda_recurrent-threads": (
        lambda: kda_recurrent_metal(*RECURRENT[0], **RECURRENT[1], rows_per_group=17),
        r"kda_recurrent: rows_per_group=17 asks for 544 threads .*; at most 16 rows",
    ),
    "kda_chunked_scan-threads": (
        lambda: kda_chunked_metal(*CHUNKED, chunk_size=8, simdgroups=17),
        r"kda_chunked_scan: simdgroups=17 asks for 544 threads .*; at most 16 SIMD-groups",
    ),
    "kda_chunked_prep-threads": (
        lambda: kda_chunked_metal(*CHUNKED_128, chunk_size=32, prep_simdgroups=17),
        r"kda_chunked_prep: prep_simdgroups=17, prep_slab=32 asks for 544 threads .*; at most 16 SIMD-groups",
    ),
    "kda_chunked_prep-memory": (
        lambda: kda_chunked_metal(*CHUNKED_128, chunk_size=32, prep_slab=64),
        r"kda_chunked_prep: prep_simdgroups=4, prep_slab=64 asks for 40064 bytes of threadgroup memory, above the "
        r"limit of 32768 bytes .*; a narrower prep_slab",
    ),
    "ggml_matvec-threads": (
        lambda: matvec_metal(X, mx.array(GGML), "IQ4_NL", rows_per_threadgroup=17),
        r"ggml_matvec: rows_per_threadgroup=17 asks for 544 threads .*; at most 16 rows",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_settings_past_the_limits_are_refused_before_launch(case, kernels):
    """A setting past the thread or threadgroup-memory limit is a ValueError naming the kernel, the setting, its
    value, what it asks for and the limit, raised before any launch (on a GPU MLX would raise only from mx.eval)."""
    call, message = REFUSED[case]
    with kernels.active(), pytest.raises(ValueError, match=message):
        call()
    assert kernels.launched == []


# -- 64-bit indices --------------------------------------------------------------------------------------------


@pytest.fixture(name="narrow")
def narrow_fixture() -> KernelBackend:
    """Kernels in the emulator with a 16-bit ``uint`` in their bodies (``metal_support.NARROW_UINT``)."""
    return KernelBackend(narrow_uint=True)


def _run_narrow(narrow, kernel, launch, pure):
    """``launch()`` with narrowed kernels equals ``pure()`` (both tuples of arrays) and ran ``kernel``."""
    with narrow.active():
        got = launch()
        mx.eval(got)
    with metal.disabled():
        ref = pure()
    for i, (g, r) in enumerate(zip(got, ref)):
        assert_matches(g, r, f"{kernel} output {i} with a 16-bit uint")
    assert f"kimi_{kernel}" in narrow.launched
    narrow.assert_clean()


def test_attn_res_mix_indices_past_uint(narrow):
    """raw [K, N, D] with K N D = 2 * 40 * 1024 = 81,920 > 2^16 elements: ``(i * N + row) * D + j`` in 64 bits (the
    scaled-down case of K3's 74,899 rows)."""
    blocks, scales, partial, w_eff = mix_inputs(2, 1, 40, 1024, mx.float32)
    _run_narrow(narrow, "attn_res_mix", lambda: (attn_res_mix_metal(blocks, scales, partial, w_eff, EPS),),
                lambda: (attn_res_mix(blocks, scales, partial, w_eff, EPS),))  # fmt: skip


def test_kda_recurrent_indices_past_uint(narrow):
    """q, k, f [B, T, H, Dk] with T H Dk = 260 * 2 * 128 = 66,560 > 2^16 elements (the scaled-down case of a
    1M-token call at Kimi Linear's 32 heads)."""
    args, kw = recurrent_inputs(1, 260, 2, 128, 32, mx.float32, None, ragged=True)
    _run_narrow(narrow, "kda_recurrent", lambda: kda_recurrent_metal(*args, **kw, rows_per_group=8),
                lambda: kda_gated(*args, **kw))  # fmt: skip


def test_kda_chunked_indices_past_uint(narrow):
    """Intra-chunk buffers of 5 chunks * 4 heads * 2C * Dk = 81,920 > 2^16 elements (prep and scan kernels)."""
    args = chunked_inputs(3, 1, 80, 4, 128, 128)
    _run_narrow(narrow, "kda_chunked_scan", lambda: kda_chunked_metal(*args, chunk_size=16),
                lambda: kda_chunked(*args, chunk_size=16))  # fmt: skip


@pytest.mark.parametrize(("B", "T"), [(5, 1), (1, 5)], ids=["decode", "prefill"])
def test_mla_indices_past_uint(B, T, narrow):
    """q_lat / o_lat [B, H, T, 512] with B H T 512 = 5 * 32 * 512 = 81,920 > 2^16 elements."""
    args = _mla(KL, B, T, 40)
    _run_narrow(narrow, "mla_decode" if T == 1 else "mla_prefill", lambda: (mla_attention_metal(*args),),
                lambda: (mla_attention(*args, key_block=16),))  # fmt: skip
