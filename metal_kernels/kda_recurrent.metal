// kda_recurrent: token-by-token KDA (per-channel decay delta rule) with the decode prologue fused in:
//   q, k L2-normalised in float32 (x * rsqrt(sum x^2 + eps)), q then scaled; beta = sigmoid(b);
//   log-decay g from the raw projection f (per channel c of head h, z = f + dt_bias[h*Dk + c]):
//     LOWER_BOUND = false:  g = -exp(A_log[h]) * softplus(z)
//     LOWER_BOUND = true:   g = lower_bound * sigmoid(exp(A_log[h]) * z)        (Kimi-K3)
//   per step, state row S[dv, :] (float32):  S *= exp(g);  S += beta (v[dv] - S.k) k;  y[dv] = S.q
//   masked steps (mask false) leave the state untouched and write y = 0.
// grid: (32, Dv, B*H)    threadgroup: (32, R, 1), any R (edge threadgroups may be partial)
//   one SIMD-group per state row (b, h, dv); lane l owns channels l, l + 32, ... (Dk / 32 of them). No threadgroup
//   memory; 32 R threads within kimi_mlx.metal.MAX_THREADS_PER_THREADGROUP (checked by kda_recurrent_metal).
// Token and state indices are 64-bit: B T H Dk passes 2^32 from T = 349,526 tokens at K3's H = 96, Dk = 128.
// template: InT (q, k, v, y), GT (f, b), Dk, Dv (multiples of 32), LOWER_BOUND (bool)
// inputs:
//   q, k      [B, T, H, Dk]  InT        raw (post short-conv) queries / keys
//   v         [B, T, H, Dv]  InT
//   f         [B, T, H, Dk]  GT         raw decay projection f_b(f_a(x))
//   b         [B, T, H]      GT         beta logits
//   A_log     [H]            float32
//   dt_bias   [H * Dk]       float32
//   state_in  [B, H, Dv, Dk] float32
//   mask      [B, T]         bool       true = real token
//   T         scalar int32;  scale, eps, lower_bound  scalar float32
// outputs:
//   y         [B, T, H, Dv]  InT
//   state_out [B, H, Dv, Dk] float32
// @inputs q k v f b A_log dt_bias state_in mask T scale eps lower_bound
// @outputs y state_out
// @body
constexpr int NPT = Dk / 32;
const ulong n = thread_position_in_grid.z;  // b * H + h
const uint dv = thread_position_in_grid.y;
const uint lane = thread_index_in_simdgroup;
const int H = int(q_shape[2]);
const ulong bi = n / H;
const uint h = n % H;

const float rate = metal::exp(A_log[h]);
float state[NPT];
float bias[NPT];
for (int i = 0; i < NPT; ++i) {
  const uint c = lane + 32 * i;
  state[i] = state_in[(n * Dv + dv) * Dk + c];
  bias[i] = dt_bias[h * Dk + c];
}

for (int t = 0; t < T; ++t) {
  const ulong row = (bi * T + t) * H + h;  // index of (b, t, h)
  if (mask[bi * T + t]) {
    float qv[NPT], kv[NPT];
    float qss = 0.0f, kss = 0.0f;
    for (int i = 0; i < NPT; ++i) {
      const uint c = lane + 32 * i;
      qv[i] = static_cast<float>(q[row * Dk + c]);
      kv[i] = static_cast<float>(k[row * Dk + c]);
      qss += qv[i] * qv[i];
      kss += kv[i] * kv[i];
    }
    const float rq = metal::rsqrt(simd_sum(qss) + eps);
    const float rk = metal::rsqrt(simd_sum(kss) + eps);
    const float beta = 1.0f / (1.0f + metal::exp(-static_cast<float>(b[row])));

    float kv_mem = 0.0f;
    for (int i = 0; i < NPT; ++i) {
      const float z = static_cast<float>(f[row * Dk + lane + 32 * i]) + bias[i];
      float g;
      if (LOWER_BOUND) {
        g = lower_bound / (1.0f + metal::exp(-rate * z));
      } else {
        g = -rate * (metal::max(z, 0.0f) + log1p(metal::exp(-metal::fabs(z))));
      }
      qv[i] = qv[i] * rq * scale;
      kv[i] = kv[i] * rk;
      state[i] = state[i] * metal::exp(g);
      kv_mem += state[i] * kv[i];
    }
    kv_mem = simd_sum(kv_mem);
    const float delta = (static_cast<float>(v[row * Dv + dv]) - kv_mem) * beta;

    float out = 0.0f;
    for (int i = 0; i < NPT; ++i) {
      state[i] = state[i] + delta * kv[i];
      out += state[i] * qv[i];
    }
    out = simd_sum(out);
    if (lane == 0) {
      y[row * Dv + dv] = static_cast<InT>(out);
    }
  } else if (lane == 0) {
    y[row * Dv + dv] = static_cast<InT>(0.0f);
  }
}

for (int i = 0; i < NPT; ++i) {
  state_out[(n * Dv + dv) * Dk + lane + 32 * i] = state[i];
}
