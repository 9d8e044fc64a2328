"""MoonViT-3d vision tower of Kimi-K3 (image path), in MLX.

Conventions:
* Patches are row-major over the patch grid: frame t, then y, then x. ``pixel_values[n]`` is the (C=3, P, P) patch n.
* A merged token concatenates its kh*kw = 4 patches in (dy, dx) order (0,0), (0,1), (1,0), (1,1): width M = 4*D.
* One image (or one video, t > 1) per call: attention is full and bidirectional over all patches of the call, so
  several images must be run one at a time (attention must stay within one image).

Pipeline (parameter names match the checkpoint's ``vision_tower.*`` tensors):
patch_embed.proj (Conv2d 3->D, kernel = stride = P, no bias) + patch_embed.pos_emb.weight [H0, W0, D] (bilinear,
half-pixel, clamped, resized to the grid when it differs) [+ fixed sin-cos time embedding when t > 1]
-> encoder.blocks[i]: x += wo(sdpa(rope(q), rope(k), v)), q|k|v = wqkv(norm0(x)) split [3, H, hd];
   x += mlp.fc1(gelu_tanh(mlp.fc0(norm1(x)))) -> encoder.final_layernorm (RMSNorm eps 2^-7, see config.TOWER_NORM_EPS)
-> temporal mean + 2x2 merge -> [N / (kh*kw), kh*kw, D].
2-D rotary: theta 10000, hd/4 frequencies f_i = 10000^(-4i/hd); pair j (elements 2j, 2j+1, rotated as a complex
number) of each head gets angle x*f_{j//2} for even j and y*f_{j//2} for odd j (x/y interleaved pair-wise).
Video (t > 1) follows the reference description (time embedding, per-frame rotary, temporal mean) but only t = 1 is
checked against a reference.
"""

from __future__ import annotations


import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .config import VisionConfig

ATTENTION_SCORE_BYTES = 256 << 20  # attention scores one query block may hold (see ``attention``)


def _bilinear_index(n_out: int, n_in: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """torch F.interpolate(mode="bilinear", align_corners=False) source indices and weights along one axis."""
    scale = n_in / n_out
    src = np.maximum((np.arange(n_out, dtype=np.float32) + 0.5) * np.float32(scale) - 0.5, 0).astype(np.float32)
    i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    i1 = np.minimum(i0 + 1, n_in - 1)
    lam = (src - i0).astype(np.float32)
    return i0, i1, lam


def interpolate_pos_emb(table: mx.array, h: int, w: int) -> mx.array:
    """[H0, W0, D] -> [h, w, D], bilinear with half-pixel centres, no antialias; same-size grids return the table."""
    h0, w0, _ = table.shape
    if (h, w) == (h0, w0):
        return table
    y0, y1, ly = _bilinear_index(h, h0)
    x0, x1, lx = _bilinear_index(w, w0)
    t = table.astype(mx.float32)
    ly = mx.array(ly)[:, None, None]  # [h, 1, 1]
    lx = mx.array(lx)[None, :, None]  # [1, w, 1]
    rows0, rows1 = t[mx.array(y0)], t[mx.array(y1)]  # [h, W0, D]
    top = rows0[:, mx.array(x0)] * (1 - lx) + rows0[:, mx.array(x1)] * lx  # [h, w, D]
    bot = rows1[:, mx.array(x0)] * (1 - lx) + rows1[:, mx.array(x1)] * lx  # [h, w, D]
    return (top * (1 - ly) + bot * ly).astype(table.dtype)  # [h, w, D]


def time_embedding(t: int, dim: int) -> mx.array:
    """[t, dim] fixed 1-D sin-cos: row tau = [sin(tau*omega) | cos(tau*omega)], omega_i = 1/10000^(i/(dim/2))."""
    omega = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float64) / (dim / 2))
    ang = np.arange(t, dtype=np.float64)[:, None] * omega[None, :]
    return mx.array(np.concatenate([np.sin(ang), np.cos(ang)], axis=1).astype(np.float32))


def rope_2d(t: int, h: int, w: int, head_dim: int) -> tuple[mx.array, mx.array]:
    """cos, sin [t*h*w, head_dim/2] for the x/y-interleaved 2-D rotary (pair j: x for even j, y for odd j)."""
    freqs = 10000.0 ** (-4.0 * np.arange(head_dim // 4, dtype=np.float64) / head_dim)  # [hd/4]
    ys, xs = np.meshgrid(np.arange(h, dtype=np.float64), np.arange(w, dtype=np.float64), indexing="ij")  # [h, w]
    ax = xs.reshape(-1, 1) * freqs  # [h*w, hd/4]
    ay = ys.reshape(-1, 1) * freqs  # [h*w, hd/4]
    ang = np.stack([ax, ay], axis=-1).reshape(h * w, head_dim // 2)  # [h*w, hd/2]: x0, y0, x1, y1, ...
    ang = np.tile(ang, (t, 1)).astype(np.float32)  # [t*h*w, hd/2], the same table per frame
    return mx.array(np.cos(ang)), mx.array(np.sin(ang))


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """x [N, H, hd]; rotates adjacent pairs (2j, 2j+1) by the angle of pair j."""
    n, nh, hd = x.shape
    xp = x.reshape(n, nh, hd // 2, 2)  # [N, H, hd/2, 2]
    re, im = xp[..., 0], xp[..., 1]  # [N, H, hd/2]
    c, s = cos[:, None, :], sin[:, None, :]  # [N, 1, hd/2]
    out = mx.stack([re * c - im * s, re * s + im * c], axis=-1)  # [N, H, hd/2, 2]
    return out.reshape(n, nh, hd)


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """q, k, v [1, H, N, hd] -> [1, H, N, hd]: full bidirectional attention over one image's N patches, through
    ``mx.fast.scaled_dot_product_attention`` with the queries in blocks, so that the scores one block holds
    ([H, block, N], counted as float32) stay within ``ATTENTION_SCORE_BYTES`` (one call when they fit). Each query
    row sees every key either way: the blocks change the memory, not the result. Without blocks the largest image
    K3 allows (in_patch_limit 65536 patches, 12 heads) would hold 12 x 65536^2 float32 scores (206 GB) where the
    kernel materialises them (MLX's CPU backend). Blocks are evaluated one by one (MLX allocates the buffers of a
    whole graph before its kernels run, so lazy blocks would hold every block's scores at once): call it eagerly."""
    _, h, n, _ = q.shape
    block = max(1, ATTENTION_SCORE_BYTES // (h * n * 4))
    if block >= n:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
    parts = []
    for i in range(0, n, block):
        parts.append(mx.fast.scaled_dot_product_attention(q[:, :, i : i + block], k, v, scale=scale))
        mx.eval(parts[-1])  # [1, H, block, hd] now: a lazy graph would allocate every block's scores up front
    return mx.concatenate(parts, axis=2)  # [1, H, N, hd]


class PosEmb(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.weight = mx.zeros((cfg.pos_emb_height, cfg.pos_emb_width, cfg.hidden_size))  # [H0, W0, D]


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        p = cfg.patch_size
        self.proj = nn.Conv2d(3, cfg.hidden_size, kernel_size=p, stride=p, bias=False)  # weight [D, P, P, 3] (NHWC)
        self.pos_emb = PosEmb(cfg)

    def __call__(self, pixel_values: mx.array, grid: tuple[int, int, int]) -> mx.array:
        t, h, w = grid
        x = pixel_values.astype(self.proj.weight.dtype).transpose(0, 2, 3, 1)  # [N, P, P, 3]
        x = self.proj(x).reshape(x.shape[0], -1)  # [N, D]
        pos = interpolate_pos_emb(self.pos_emb.weight, h, w).reshape(h * w, -1)  # [h*w, D]
        if t > 1:
            pos = (pos[None] + time_embedding(t, pos.shape[-1])[:, None, :].astype(pos.dtype)).reshape(t * h * w, -1)
        return x + pos.astype(x.dtype)  # [N, D]


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc0 = nn.Linear(dim, hidden, bias=False)
        self.fc1 = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc1(nn.gelu_approx(self.fc0(x)))  # gelu_pytorch_tanh


class Block(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d, q = cfg.hidden_size, cfg.qkv_hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.norm0 = nn.RMSNorm(d, eps=cfg.tower_norm_eps)
        self.norm1 = nn.RMSNorm(d, eps=cfg.tower_norm_eps)
        self.wqkv = nn.Linear(d, 3 * q, bias=False)
        self.wo = nn.Linear(q, d, bias=False)
        self.mlp = MLP(d, cfg.intermediate_size)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        n = x.shape[0]
        qkv = self.wqkv(self.norm0(x)).reshape(n, 3, self.num_heads, self.head_dim)  # [N, 3, H, hd]
        q = apply_rope(qkv[:, 0], cos, sin)  # [N, H, hd]
        k = apply_rope(qkv[:, 1], cos, sin)  # [N, H, hd]
        v = qkv[:, 2]  # [N, H, hd]
        q, k, v = (a.transpose(1, 0, 2)[None] for a in (q, k, v))  # [1, H, N, hd]
        o = attention(q, k, v, self.head_dim**-0.5)  # [1, H, N, hd]
        x = x + self.wo(o[0].transpose(1, 0, 2).reshape(n, -1))  # [N, D]
        return x + self.mlp(self.norm1(x))  # [N, D]


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.blocks = [Block(cfg) for _ in range(cfg.num_layers)]
        self.final_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.tower_norm_eps)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        for blk in self.blocks:
            x = blk(x, cos, sin)
        return self.final_layernorm(x)  # [N, D]


def check_grid(pixel_values: mx.array, grid_thw, cfg: VisionConfig) -> tuple[int, int, int]:
    """grid_thw (t, h, w) as ints (accepts [3] or [1, 3]); checks it against pixel_values and the merge kernel."""
    g = np.asarray(grid_thw).reshape(-1)
    if g.shape != (3,):
        raise ValueError(f"grid_thw must be one (t, h, w) triple (one image per call); got shape {np.shape(grid_thw)}")
    t, h, w = (int(v) for v in g)
    p, (kh, kw) = cfg.patch_size, cfg.merge_kernel
    if min(t, h, w) <= 0 or h % kh or w % kw:
        raise ValueError(f"grid_thw {(t, h, w)}: h, w must be positive multiples of the merge kernel {(kh, kw)}")
    if tuple(pixel_values.shape) != (t * h * w, 3, p, p):
        raise ValueError(f"pixel_values has shape {tuple(pixel_values.shape)}; grid_thw {(t, h, w)} needs "
                         f"{(t * h * w, 3, p, p)}")
    return t, h, w


class VisionTower(nn.Module):
    """pixel_values [N, 3, P, P] + grid_thw (t, h, w) of ONE image -> merged [N/(kh*kw), kh*kw, D]."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.encoder = Encoder(cfg)

    def embed(self, pixel_values: mx.array, grid_thw) -> mx.array:
        """Block-0 input: patch embedding + position embedding, [N, D]."""
        return self.patch_embed(pixel_values, check_grid(pixel_values, grid_thw, self.cfg))

    def encode(self, pixel_values: mx.array, grid_thw) -> mx.array:
        """Encoder output after final_layernorm, [N, D]."""
        t, h, w = check_grid(pixel_values, grid_thw, self.cfg)
        x = self.patch_embed(pixel_values, (t, h, w))  # [N, D]
        cos, sin = rope_2d(t, h, w, self.cfg.head_dim)  # [N, hd/2] each
        return self.encoder(x, cos.astype(x.dtype), sin.astype(x.dtype))  # [N, D]

    def merge(self, x: mx.array, grid_thw) -> mx.array:
        """[t*h*w, D] -> temporal mean + kh x kw merge -> [h/kh * w/kw, kh*kw, D]."""
        t, h, w = (int(v) for v in np.asarray(grid_thw).reshape(-1))
        kh, kw = self.cfg.merge_kernel
        d = x.shape[-1]
        x = x.reshape(t, h // kh, kh, w // kw, kw, d).transpose(0, 1, 3, 2, 4, 5)  # [t, h/kh, w/kw, kh, kw, D]
        x = x.mean(axis=0) if t > 1 else x[0]  # [h/kh, w/kw, kh, kw, D]
        return x.reshape((h // kh) * (w // kw), kh * kw, d)  # [N/(kh*kw), kh*kw, D]

    def __call__(self, pixel_values: mx.array, grid_thw) -> mx.array:
        return self.merge(self.encode(pixel_values, grid_thw), grid_thw)
