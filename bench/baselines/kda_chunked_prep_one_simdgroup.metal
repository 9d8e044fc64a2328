// KDA chunked prefill, intra-chunk part: everything of a chunk that does not depend on the carried state, i.e. what
// kimi_mlx.ops.kda._intra_chunk computes, for one chunk per threadgroup, straight from the [B, T, H, D] inputs.
// Its outputs feed metal_kernels/kda_chunked_scan.metal; host side: kimi_mlx/ops/kda_chunked_metal.py.
//
// Chunk tokens t = t0 + n*C + i (i < C). Tokens at t >= t1 are padding (q = k = v = 0, g = 0, beta = 0) and masked
// tokens (mask false) get g = 0, beta = 0: both are identity steps on the state, as in the pure path.
// Decays are never exp of a difference of cumulative sums: exp(G_i - G_j) = prod_{j < t <= i} exp(g_t) is a running
// product of factors <= 1 anchored at column j, and exp(G_i), exp(G_C - G_j) are prefix / suffix products, so
// g = -1000 gives exact zeros and nothing overflows or cancels.
//   Aqk[i, j] = sum_c q_ic k_jc exp(G_ic - G_jc) (j <= i);  Akk[i, j] = beta_i sum_c k_ic k_jc exp(G_ic - G_jc) (j < i)
//   Linv = (I + Akk)^-1 (forward substitution, one lane per column);  Lb = Linv diag(beta);  M = Aqk Lb
//   wq = [Lb (K exp(G)); Q exp(G) - M (K exp(G))];  uo = [Lb V; M V];  kg = K exp(G_C - G);  decay = exp(G_C)
//
// Grid (32, N, B * H), N = ceil((t1 - t0) / C); threadgroup (32, 1, 1): one SIMD-group per (chunk, b, h). Lanes split
// Dk (and Dv) as k = j * 32 + lane; the C x C matrices live in threadgroup memory (3 C^2 floats: 12 KB at C = 32, the
// largest chunk, within 32 KB). Buffer offsets are 64-bit (size_t); ints hold positions along one axis (tokens < 2^31).
// Template: QT, KT, VT (q, k, v dtypes), C (8, 16 or 32), Dk, Dv, H (ints; Dk, Dv multiples of 32).
// Inputs:
//   q, k  [B, T, H, Dk] QT, KT   q L2-normalised and pre-scaled by Dk^-0.5, k L2-normalised
//   v     [B, T, H, Dv] VT
//   g     [B, T, H, Dk] float32  per-channel log-decay (<= 0)
//   beta  [B, T, H] float32
//   mask  [B, T] bool            True = real token
//   T, t0, t1  int32 scalars     sequence length; this launch covers tokens [t0, t1)
// Outputs (float32, chunk-major like kda._intra_chunk's output):
//   wq [N, B, H, 2C, Dk];  uo [N, B, H, 2C, Dv];  kg [N, B, H, C, Dk];  decay [N, B, H, Dk]
// @inputs q k v g beta mask T t0 t1
// @outputs wq uo kg decay

constexpr int NK = Dk / 32;
constexpr int NV = Dv / 32;
threadgroup float aqk[C * C];
threadgroup float akk_m[C * C];  // Akk, then M = Aqk Lb
threadgroup float lb[C * C];     // Linv, then Lb = Linv diag(beta)

const uint lane = thread_position_in_threadgroup.x;
const uint n = thread_position_in_grid.y;
const uint bh = thread_position_in_grid.z;
const uint BH = threads_per_grid.z;
const uint b = bh / H;
const uint h = bh % H;
const int ts = t0 + int(n) * C;  // first token of the chunk
const size_t cb = size_t(n) * BH + bh;

auto q_ = q + (size_t(b) * T * H + h) * Dk + lane;  // token t, channel j*32 + lane: q_[t * H * Dk + j * 32]
auto k_ = k + (size_t(b) * T * H + h) * Dk + lane;
auto g_ = g + (size_t(b) * T * H + h) * Dk + lane;
auto v_ = v + (size_t(b) * T * H + h) * Dv + lane;
auto beta_ = beta + size_t(b) * T * H + h;
auto mask_ = mask + size_t(b) * T;
auto wq_ = wq + cb * (2 * C * Dk) + lane;
auto uo_ = uo + cb * (2 * C * Dv) + lane;
auto kg_ = kg + cb * (C * Dk) + lane;
auto decay_ = decay + cb * Dk + lane;

// 1. Aqk and Akk, column by column: r = exp(G_i - G_j) as a running product over i > j.
for (int j = 0; j < C; ++j) {
  const int tj = ts + j;
  const bool vj = tj < t1;
  float kj[NK];
  float r[NK];
  float p = 0.0f;
  for (int c = 0; c < NK; ++c) {
    kj[c] = vj ? float(k_[size_t(tj) * H * Dk + c * 32]) : 0.0f;
    p += (vj ? float(q_[size_t(tj) * H * Dk + c * 32]) : 0.0f) * kj[c];
    r[c] = 1.0f;
  }
  p = simd_sum(p);
  if (lane == 0) {
    aqk[j * C + j] = p;
  }
  for (int i = j + 1; i < C; ++i) {
    const int ti = ts + i;
    const bool vi = ti < t1;
    const bool live = vi && mask_[ti];
    float pq = 0.0f;
    float pk = 0.0f;
    for (int c = 0; c < NK; ++c) {
      const size_t at = size_t(vi ? ti : 0) * H * Dk + c * 32;
      r[c] *= live ? metal::exp(g_[at]) : 1.0f;
      const float kr = kj[c] * r[c];
      pq += (vi ? float(q_[at]) : 0.0f) * kr;
      pk += (vi ? float(k_[at]) : 0.0f) * kr;
    }
    pq = simd_sum(pq);
    pk = simd_sum(pk);
    if (lane == 0) {
      aqk[i * C + j] = pq;
      akk_m[i * C + j] = live ? beta_[size_t(ti) * H] * pk : 0.0f;
    }
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// 2. Linv = (I + Akk)^-1 by forward substitution, lane j owns column j (reads only its own column of lb).
if (lane < C) {
  const int j = lane;
  for (int i = 0; i < C; ++i) {
    float x = i == j ? 1.0f : 0.0f;
    for (int m = j; m < i; ++m) {
      x -= akk_m[i * C + m] * lb[m * C + j];
    }
    lb[i * C + j] = x;
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// 3. M = Aqk Linv diag(beta) into akk_m, then Lb = Linv diag(beta); lane j owns column j.
if (lane < C) {
  const int j = lane;
  const int tj = ts + j;
  const float bj = (tj < t1 && mask_[tj]) ? float(beta_[size_t(tj) * H]) : 0.0f;
  for (int i = j; i < C; ++i) {
    float x = 0.0f;
    for (int m = j; m <= i; ++m) {
      x += aqk[i * C + m] * lb[m * C + j];
    }
    akk_m[i * C + j] = x * bj;
  }
  for (int i = j; i < C; ++i) {
    lb[i * C + j] *= bj;
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// 4. Per lane channel (lanes only touch their own channels of wq / kg / decay from here on).
//    wq rows 0..C-1 <- X = K exp(G), rows C..2C-1 <- Q exp(G); decay <- exp(G_C).
float gam[NK];
for (int c = 0; c < NK; ++c) {
  gam[c] = 1.0f;
}
for (int m = 0; m < C; ++m) {
  const int tm = ts + m;
  const bool vm = tm < t1;
  const bool live = vm && mask_[tm];
  for (int c = 0; c < NK; ++c) {
    const size_t at = size_t(vm ? tm : 0) * H * Dk + c * 32;
    gam[c] *= live ? metal::exp(g_[at]) : 1.0f;
    wq_[m * Dk + c * 32] = (vm ? float(k_[at]) : 0.0f) * gam[c];
    wq_[(C + m) * Dk + c * 32] = (vm ? float(q_[at]) : 0.0f) * gam[c];
  }
}
for (int c = 0; c < NK; ++c) {
  decay_[c * 32] = gam[c];
  gam[c] = 1.0f;  // reused as the suffix product exp(G_C - G_m)
}
for (int m = C - 1; m >= 0; --m) {
  const int tm = ts + m;
  const bool vm = tm < t1;
  const bool live = vm && mask_[tm];
  for (int c = 0; c < NK; ++c) {
    const size_t at = size_t(vm ? tm : 0) * H * Dk + c * 32;
    kg_[m * Dk + c * 32] = (vm ? float(k_[at]) : 0.0f) * gam[c];
    gam[c] *= live ? metal::exp(g_[at]) : 1.0f;
  }
}
// Q exp(G) - M X (rows C..2C-1), then W = Lb X in place (descending i: rows m <= i still hold X).
for (int i = 0; i < C; ++i) {
  for (int c = 0; c < NK; ++c) {
    float x = wq_[(C + i) * Dk + c * 32];
    for (int m = 0; m <= i; ++m) {
      x -= akk_m[i * C + m] * wq_[m * Dk + c * 32];
    }
    wq_[(C + i) * Dk + c * 32] = x;
  }
}
for (int i = C - 1; i >= 0; --i) {
  for (int c = 0; c < NK; ++c) {
    float x = 0.0f;
    for (int m = 0; m <= i; ++m) {
      x += lb[i * C + m] * wq_[m * Dk + c * 32];
    }
    wq_[i * Dk + c * 32] = x;
  }
}

// 5. uo = [Lb V; M V], lanes over Dv.
for (int i = 0; i < C; ++i) {
  for (int c = 0; c < NV; ++c) {
    float u = 0.0f;
    float o = 0.0f;
    for (int m = 0; m <= i; ++m) {
      const int tm = ts + m;
      const float vm = tm < t1 ? float(v_[size_t(tm) * H * Dv + c * 32]) : 0.0f;
      u += lb[i * C + m] * vm;
      o += akk_m[i * C + m] * vm;
    }
    uo_[i * Dv + c * 32] = u;
    uo_[(C + i) * Dv + c * 32] = o;
  }
}
