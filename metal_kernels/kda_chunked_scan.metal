// KDA chunked prefill: the part that is sequential across chunks (inter-chunk state recurrence + outputs).
// Body for mx.fast.metal_kernel; host side: kimi_mlx/ops/kda_chunked_metal.py (intra-chunk quantities come from
// kimi_mlx.ops.kda._intra_chunk, so every decay factor was formed from exponents <= 0).
//
// Per chunk n of C tokens, per (b, h), fla orientation S[Dk, Dv]:
//   WS = WQ @ S;  Vnew = UO[:C] - WS[:C];  O = UO[C:] + WS[C:];  S <- diag(decay) S + Kg^T @ Vnew
// Columns of S (one per Dv index) are independent: one SIMD-group per (b, h, dv) column, its 32 lanes split Dk
// (lane owns k = j * 32 + lane, j < Dk / 32) and reduce the dot products with simd_sum. No threadgroup memory,
// no barriers; a threadgroup is 32 x TG_COLS SIMD-groups of independent columns (any TG_COLS, edge groups partial).
//
// Grid (32, Dv, B * H); threadgroup (32, TG_COLS, 1).
// Template: OutT (output dtype), C (chunk size), Dk, Dv, H (ints; Dk a multiple of 32).
// Inputs (float32 unless noted; N = ceil(T / C) chunks, chunk-major like kda._intra_chunk's output):
//   wq       [N, B, H, 2C, Dk]  [W; Q*exp(G) - Aqk W]
//   uo       [N, B, H, 2C, Dv]  [U; Aqk U]
//   kg       [N, B, H, C, Dk]   K * exp(G_C - G)
//   decay    [N, B, H, Dk]      exp(G_C)
//   state_in [B, H, Dv, Dk]     initial state (mlx-lm orientation)
//   mask     [B, T] bool        True = real token (false: output 0; its step is an identity on the state)
//   T        int32 scalar       tokens (the last chunk may be partial; its padded rows are not written)
// Outputs:
//   o         [B, T, H, Dv] OutT
//   state_out [B, H, Dv, Dk] float32
// @inputs wq uo kg decay state_in mask T
// @outputs o state_out

constexpr int NK = Dk / 32;
const uint lane = thread_position_in_threadgroup.x;
const uint dv = thread_position_in_grid.y;
const uint bh = thread_position_in_grid.z;
const uint BH = threads_per_grid.z;
const uint b = bh / H;
const uint h = bh % H;
const int n_chunks = (T + C - 1) / C;

float s[NK];
const device float* st_in = state_in + (size_t(bh) * Dv + dv) * Dk + lane;
for (int j = 0; j < NK; ++j) {
  s[j] = st_in[j * 32];
}

float vnew[C];
for (int n = 0; n < n_chunks; ++n) {
  const size_t cb = size_t(n) * BH + bh;
  const device float* wq_ = wq + cb * (2 * C * Dk) + lane;
  const device float* uo_ = uo + cb * (2 * C * Dv) + dv;
  const device float* kg_ = kg + cb * (C * Dk) + lane;
  const device float* decay_ = decay + cb * Dk + lane;

  // Vnew = U - W S (rows 0 .. C-1 of WQ / UO).
  for (int i = 0; i < C; ++i) {
    float p = 0.0f;
    for (int j = 0; j < NK; ++j) {
      p += wq_[i * Dk + j * 32] * s[j];
    }
    vnew[i] = uo_[i * Dv] - simd_sum(p);
  }

  // O = Aqk U + (Q exp(G) - Aqk W) S (rows C .. 2C-1), written for real rows only.
  for (int i = 0; i < C; ++i) {
    float p = 0.0f;
    for (int j = 0; j < NK; ++j) {
      p += wq_[(C + i) * Dk + j * 32] * s[j];
    }
    const float out = uo_[(C + i) * Dv] + simd_sum(p);
    const int t = n * C + i;
    if (lane == 0 && t < T) {
      o[((size_t(b) * T + t) * H + h) * Dv + dv] = mask[size_t(b) * T + t] ? static_cast<OutT>(out) : OutT(0);
    }
  }

  // S <- diag(exp(G_C)) S + Kg^T Vnew.
  for (int j = 0; j < NK; ++j) {
    float acc = s[j] * decay_[j * 32];
    for (int i = 0; i < C; ++i) {
      acc += kg_[i * Dk + j * 32] * vnew[i];
    }
    s[j] = acc;
  }
}

device float* st_out = state_out + (size_t(bh) * Dv + dv) * Dk + lane;
for (int j = 0; j < NK; ++j) {
  st_out[j * 32] = s[j];
}
