"""MLA attention's path choice and its tiled expanded form (ops/mla_attention.py, ops/mla_paths.py): outputs and
gradients against a float64 numpy reference and the plain path (one ``scaled_dot_product_attention`` call over the
whole cache expanded per head) at the bench model's, Kimi-Linear-48B's and K3's head shapes; which form runs at
which (T, S); a causal chunk's tiles skip the keys its queries cannot see and never exceed QUERY_BLOCK x KEY_BLOCK."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.mla import MultiLinear

import kimi_mlx.ops.mla_attention as mla_ops
import kimi_mlx.ops.mla_paths as mla_paths
from kimi_mlx.ops.latent import quantize
from kimi_mlx.ops.mla_paths import LeftPaddedCausal, expanded_blocks, fused

DIMS = {  # name: (heads, kv_lora_rank, qk_nope, qk_rope, v_head_dim)
    "bench": (6, 256, 64, 32, 64),  # bench/bench_vs_mlx_lm.py's model
    "kimi-linear-48b": (32, 512, 128, 64, 128),
    "k3": (96, 512, 128, 64, 128),
}


def make(dims: str, B: int, T: int, S: int, seed: int = 0, dtype=mx.float32):
    H, r, dn, dr, dv = DIMS[dims]
    rng = np.random.default_rng(seed)
    q_nope, q_pe = rng.standard_normal((B, H, T, dn)), rng.standard_normal((B, H, T, dr))
    c, kr = rng.standard_normal((B, 1, S, r)), rng.standard_normal((B, 1, S, dr))
    w_kb = rng.standard_normal((H, r, dn)) * 2 / np.sqrt(r)  # embed_q.weight: scores of order 1-10
    w_vb = rng.standard_normal((H, dv, r)) / np.sqrt(r)  # unembed_out.weight
    embed_q, unembed_out = MultiLinear(dn, r, H), MultiLinear(r, dv, H)
    embed_q.weight, unembed_out.weight = mx.array(w_kb, dtype), mx.array(w_vb, dtype)
    arrays = [mx.array(a, dtype) for a in (q_nope, q_pe, c, kr)]
    return arrays, (embed_q, unembed_out), (q_nope, q_pe, c, kr, w_kb, w_vb), (dn + dr) ** -0.5


def numpy_attention(q_nope, q_pe, c, kr, w_kb, w_vb, scale, keep):
    """float64: keys c W_kb (per head) and k_pe, values c W_vb^T; ``keep`` bool [B, T, S]."""
    (B, _, S, r), (H, _, dn), dv = c.shape, w_kb.shape, w_vb.shape[1]
    k = (c.reshape(B * S, r) @ w_kb.transpose(1, 0, 2).reshape(r, H * dn)).reshape(B, S, H, dn).transpose(0, 2, 1, 3)
    v = (c.reshape(B * S, r) @ w_vb.transpose(2, 0, 1).reshape(r, H * dv)).reshape(B, S, H, dv).transpose(0, 2, 1, 3)
    s = scale * (q_nope @ k.swapaxes(-1, -2) + q_pe @ kr.swapaxes(-1, -2))  # [B, H, T, S]
    s = np.where(keep[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def keep_of(mask, B: int, T: int, S: int) -> np.ndarray:
    """The bool [B, T, S] a mask stands for."""
    if mask is None:
        return np.ones((B, T, S), bool)
    if isinstance(mask, mx.array):
        return np.broadcast_to(np.array(mask)[:, 0], (B, T, S))
    causal = np.arange(S)[None, :] <= (S - T + np.arange(T))[:, None]
    if mask == "causal":
        return np.broadcast_to(causal, (B, T, S))
    pad = np.array(mask.left_padding)
    itself = np.arange(S)[None, None, :] == (S - T + np.arange(T))[None, :, None]
    return causal[None] & ((np.arange(S)[None, None, :] >= pad[:, None, None]) | itself)


def masks(B: int, T: int, S: int):
    rng = np.random.default_rng(T * S)
    scattered = rng.random((B, 1, T, S)) < 0.3
    scattered |= np.arange(S)[None, None, None, :] == (S - T + np.arange(T))[None, None, :, None]
    return {"none": None, "causal": "causal", "left-padded": LeftPaddedCausal(mx.array([0, 300][:B])),
            "bool": mx.array(scattered)}


@pytest.mark.parametrize("dims,B,T,S,mask_name", [
    ("bench", 1, 300, 300, "causal"),  # a chunk on an empty cache: 3 query blocks, one key block
    ("bench", 1, 300, 300, "none"),
    ("bench", 2, 250, 700, "causal"),  # after 450 cached keys: 2 key blocks, the diagonal across their boundary
    ("bench", 2, 250, 700, "left-padded"),  # the second row hides its first 300 keys
    ("bench", 2, 250, 700, "bool"),
    ("kimi-linear-48b", 1, 150, 560, "causal"),  # the diagonal across the first key block's end
    ("k3", 1, 130, 130, "causal"),  # K3's 96 heads, 2 query blocks
])
def test_tiles_match_float64_and_the_plain_path(dims, B, T, S, mask_name):
    """Default tiles (128 queries x 512 keys) within 2e-5 of float64 numpy and of the plain path, for every kind of
    mask, at the bench model's, Kimi-Linear-48B's and K3's head shapes."""
    (qn, qp, c, kr), (eq, uo), np_args, scale = make(dims, B, T, S)
    mask = masks(B, T, S)[mask_name]
    want = numpy_attention(*np_args, scale, keep_of(mask, B, T, S))
    got = expanded_blocks(qn, qp, [c], [kr], eq, uo, scale, mask, mla_ops.KEY_BLOCK, mla_ops.QUERY_BLOCK)
    plain = fused(qn, qp, c, kr, eq, uo, scale, mask, absorbed=False)
    top = np.abs(want).max()
    assert np.abs(np.array(got) - want).max() <= 2e-5 * top
    assert mx.abs(got - plain).max().item() <= 2e-5 * top


@pytest.mark.parametrize("key_block,query_block", [(16, 5), (24, 16), (7, 100), (1000, 1)])
def test_tile_sizes_and_pages_do_not_change_the_result(key_block, query_block):
    """Odd tile sizes over three pages (key blocks cut at page ends), causal and left-padded: equal the plain path
    over the concatenated cache within 1e-5."""
    B, T, S = 2, 45, 100
    (qn, qp, c, kr), (eq, uo), _, scale = make("bench", B, T, S, seed=1)
    pages = ([c[:, :, :30], c[:, :, 30:64], c[:, :, 64:]], [kr[:, :, :30], kr[:, :, 30:64], kr[:, :, 64:]])
    for mask in ("causal", LeftPaddedCausal(mx.array([0, 40]))):
        plain = fused(qn, qp, c, kr, eq, uo, scale, mask, absorbed=False)
        got = expanded_blocks(qn, qp, *pages, eq, uo, scale, mask, key_block, query_block)
        assert mx.abs(got - plain).max().item() <= 1e-5 * mx.abs(plain).max().item(), mask


def test_quantized_and_half_caches():
    """An 8-bit latent cache's tiles equal the plain path over its dequantized cache; bfloat16 inputs stay within
    bfloat16 rounding of the float32 result."""
    B, T, S = 1, 200, 520
    (qn, qp, c, kr), (eq, uo), _, scale = make("bench", B, T, S, seed=2)
    qc, qkr = quantize(c, 8, 64), quantize(kr, 8, 32)
    deq = [mx.dequantize(x.codes, x.scales, x.biases, group_size=x.group_size, bits=x.bits) for x in (qc, qkr)]
    plain = fused(qn, qp, *deq, eq, uo, scale, "causal", absorbed=False)
    got = mla_ops.mla_attention(qn, qp, qc, qkr, eq, uo, scale, "causal")
    assert mx.abs(got - plain).max().item() <= 1e-5 * mx.abs(plain).max().item()

    (hn, hp, hc, hkr), (heq, huo), _, _ = make("bench", B, T, S, seed=2, dtype=mx.bfloat16)
    f32 = mla_ops.mla_attention(qn, qp, c, kr, eq, uo, scale, "causal")
    half = mla_ops.mla_attention(hn, hp, hc, hkr, heq, huo, scale, "causal")
    assert half.dtype == mx.bfloat16
    assert mx.abs(half.astype(mx.float32) - f32).max().item() <= 0.03 * mx.abs(f32).max().item()


def test_gradients_match_the_plain_path():
    """Gradients through the tiles (queries, latents, k_pe, both per-head weights) equal the plain path's within
    1e-4 (relative): training chunks take this path."""
    B, T, S = 1, 70, 90
    (qn, qp, c, kr), (eq, uo), _, scale = make("bench", B, T, S, seed=3)
    cot = mx.random.normal((B, 6, T, 64), key=mx.random.key(0))

    def loss(attend):
        def f(qn, qp, c, kr, w_kb, w_vb):
            eq.weight, uo.weight = w_kb, w_vb
            return (attend(qn, qp, c, kr) * cot).sum()
        return mx.grad(f, argnums=tuple(range(6)))(qn, qp, c, kr, eq.weight, uo.weight)

    want = loss(lambda *a: fused(*a, eq, uo, scale, "causal", absorbed=False))
    got = loss(lambda qn, qp, c, kr: expanded_blocks(qn, qp, [c], [kr], eq, uo, scale, "causal", 32, 16))
    for g, w in zip(got, want):
        assert mx.abs(g - w).max().item() <= 1e-4 * mx.abs(w).max().item()


@pytest.mark.parametrize("dims,T,S,absorbed", [
    ("bench", 1, 1000, True),  # decode
    ("bench", 64, 1024, True),  # a short chunk over a longer cache
    ("bench", 128, 4096, False),  # past the crossover (85 queries for these dims, ~79 at S = 1024)
    ("bench", 40, 40, False),  # a chunk on an empty cache: expanding is cheaper at T = S
    ("bench", 2048, 2048, False),
    ("kimi-linear-48b", 1, 10, True),
    ("kimi-linear-48b", 128, 4096, True),
    ("kimi-linear-48b", 129, 100000, False),  # above ABSORBED_MAX_QUERIES whatever the flops say (170)
    ("kimi-linear-48b", 512, 4096, False),
    ("k3", 16, 16, False),
    ("k3", 32, 2048, True),
])
def test_form_choice(dims, T, S, absorbed):
    """``absorbs`` picks the form with fewer multiply-adds per head (capped at ABSORBED_MAX_QUERIES queries), and
    ``mla_attention`` runs it: expanded_blocks for the expanded form, absorbed_blocks or the fused latent call for
    the absorbed one."""
    H, r, dn, dr, dv = DIMS[dims]
    assert mla_ops.absorbs(T, S, r, dn, dv) == absorbed
    if T * S > 300_000:
        return
    (qn, qp, c, kr), (eq, uo), _, scale = make(dims, 1, T, S)
    seen = []
    for name in ("expanded_blocks", "absorbed_blocks", "fused"):
        fn = getattr(mla_ops, name)
        setattr(mla_ops, name, lambda *a, _fn=fn, _name=name, **k: seen.append(_name) or _fn(*a, **k))
    try:
        mla_ops.mla_attention(qn, qp, c, kr, eq, uo, scale, "causal" if T > 1 else None)
    finally:
        for name in ("expanded_blocks", "absorbed_blocks", "fused"):
            setattr(mla_ops, name, getattr(mla_paths, name))
    assert seen in ([["absorbed_blocks"], ["fused"]] if absorbed else [["expanded_blocks"]])


@pytest.mark.parametrize("T,S", [(2048, 2048), (512, 4096), (300, 300)])
def test_causal_tiles_skip_hidden_keys(T, S, monkeypatch):
    """A causal chunk's tiles are at most QUERY_BLOCK x KEY_BLOCK and cover exactly each query block's keys up to
    its last query: no key after it (a chunk on an empty cache computes (1 + 128 / T) / 2 of its T x T scores), and
    only the square diagonal tiles are masked."""
    H, r, dn, dr, dv = DIMS["bench"]
    qn, qp = mx.zeros((1, H, T, dn)), mx.zeros((1, H, T, dr))
    c, kr = mx.zeros((1, 1, S, r)), mx.zeros((1, 1, S, dr))
    eq, uo = MultiLinear(dn, r, H), MultiLinear(r, dv, H)
    tiles, masked = [], []
    step, where = mla_paths._softmax_step, mx.where
    monkeypatch.setattr(mla_paths, "_softmax_step", lambda state, s, weigh: tiles.append(s.shape) or step(state, s,
                                                                                                         weigh))
    monkeypatch.setattr(mla_paths.mx, "where", lambda m, a, b: masked.append(a.shape) or where(m, a, b))
    mla_ops.mla_attention(qn, qp, c, kr, eq, uo, 1.0, "causal")
    Q, K = mla_ops.QUERY_BLOCK, mla_ops.KEY_BLOCK
    assert all(t[2] <= Q and t[3] <= K for t in tiles)
    blocks = [(r0, min(r0 + Q, T)) for r0 in range(0, T, Q)]
    assert sum(t[2] * t[3] for t in tiles) == sum((r1 - r0) * (S - T + r1) for r0, r1 in blocks)
    assert sum(t[2] * t[3] for t in masked) == sum((r1 - r0) ** 2 for r0, r1 in blocks)
