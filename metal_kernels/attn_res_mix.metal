// attn_res_mix: Kimi-K3 AttnRes mix of K block snapshots and the running partial sum, one pass per row:
//   logit_i = (raw_i . w_eff) * inv_rms_i      (i < K; inv_rms given)
//   logit_K = (partial . w_eff) * rsqrt(mean(partial^2) + eps)
//   out     = sum_i softmax(logit)_i * value_i   (values: raw_0 .. raw_{K-1}, partial), float32 accumulation
// grid: (THREADS, N, 1)    threadgroup: (THREADS, R, 1), R <= ROWS (edge threadgroups may be partial)
//   THREADS threads (a multiple of 32) share one row of D elements (thread j handles j, j + THREADS, ...);
//   a threadgroup holds R rows; dot products reduce by simd_sum, then across SIMD-groups in threadgroup memory
//   (float red[ROWS][K + 2][THREADS / 32]: 4 ROWS (K + 2) THREADS / 32 bytes, within 32 KB; THREADS * ROWS within
//   kimi_mlx.metal.MAX_THREADS_PER_THREADGROUP: both checked by attn_res_mix_metal).
// Indices into raw / partial / out are 64-bit: K N D passes 2^32 at K3's d = 7168, K = 8 from N = 74,899 rows.
// template: InT (raw, partial, out), K (>= 1), D, THREADS, ROWS
// inputs:
//   raw      [K, N, D]  InT      block snapshots (N = B * T rows)
//   inv_rms  [K, N]     float32  their 1 / sqrt(mean(x^2) + eps)
//   partial  [N, D]     InT
//   w_eff    [D]        float32  norm_weight * proj_weight
//   eps      scalar float32
// outputs:
//   out      [N, D]     InT
// @inputs raw inv_rms partial w_eff eps
// @outputs out
// @body
constexpr int NACC = K + 2;  // K block dots, the partial's dot, the partial's sum of squares
constexpr int NSIMD = THREADS / 32;
threadgroup float red[ROWS][NACC][NSIMD];

const uint tid = thread_position_in_threadgroup.x;
const uint r = thread_position_in_threadgroup.y;
const ulong row = thread_position_in_grid.y;
const ulong N = threads_per_grid.y;  // rows
const uint lane = thread_index_in_simdgroup;
const uint sg = tid / 32;

float acc[NACC];
for (int i = 0; i < NACC; ++i) {
  acc[i] = 0.0f;
}
for (uint j = tid; j < D; j += THREADS) {
  const float w = w_eff[j];
  for (int i = 0; i < K; ++i) {
    acc[i] += static_cast<float>(raw[(i * N + row) * D + j]) * w;
  }
  const float p = static_cast<float>(partial[row * D + j]);
  acc[K] += p * w;
  acc[K + 1] += p * p;
}
for (int i = 0; i < NACC; ++i) {
  const float s = simd_sum(acc[i]);
  if (lane == 0) {
    red[r][i][sg] = s;
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (int i = 0; i < NACC; ++i) {
  float s = 0.0f;
  for (int m = 0; m < NSIMD; ++m) {
    s += red[r][i][m];
  }
  acc[i] = s;
}

// softmax over depth: logits 0..K-1 for the blocks, K for the partial sum
float logit[K + 1];
for (int i = 0; i < K; ++i) {
  logit[i] = acc[i] * inv_rms[i * N + row];
}
logit[K] = acc[K] * metal::rsqrt(acc[K + 1] / D + eps);
float top = logit[0];
for (int i = 1; i <= K; ++i) {
  top = metal::max(top, logit[i]);
}
float total = 0.0f;
for (int i = 0; i <= K; ++i) {
  logit[i] = metal::exp(logit[i] - top);
  total += logit[i];
}
for (int i = 0; i <= K; ++i) {
  logit[i] = logit[i] / total;
}

for (uint j = tid; j < D; j += THREADS) {
  float o = logit[0] * static_cast<float>(raw[row * D + j]);
  for (int i = 1; i < K; ++i) {
    o += logit[i] * static_cast<float>(raw[(i * N + row) * D + j]);
  }
  o += logit[K] * static_cast<float>(partial[row * D + j]);
  out[row * D + j] = static_cast<InT>(o);
}
