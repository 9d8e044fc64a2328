// mla_prefill: absorbed MLA attention of a chunk of T queries per (sequence, head) against S cached latent
// positions, in latent space with one key/value "head" shared by all heads:
//   score_s = q_lat . c_kv[s] + q_rot . k_pe[s]        (q_lat = embed_q(q_nope) * scale, q_rot = q_pe * scale)
//   o_lat   = sum_s softmax_s(score) * c_kv[s]          over the keys query t may see:
//             s <= S - T + t when CAUSAL (the queries are the last T of the S positions), and mask[t, s] when HAS_MASK
// with an online softmax (running max / sum / output, float32) over blocks of 32 keys.
// grid: (32 * NSG, ceil(T * H / NSG), B)    threadgroup: (32 * NSG, 1, 1)
//   One SIMD-group per query row; the rows of a batch entry are ordered t * H + h, so a threadgroup holds the NSG
//   heads of (about) one query position, which read the same keys. Lane j of a key block holds key j's score (a
//   simd_sum of the lanes' partial dots; lane i owns latent dims i, i + 32, ...); the block's probabilities are
//   broadcast lane by lane into the per-lane output. Rows past T * H (last threadgroup) return at once; no barriers.
//   A causal row stops at its last visible key. No threadgroup memory; 32 NSG threads within
//   kimi_mlx.metal.MAX_THREADS_PER_THREADGROUP (checked by mla_latent_attention_metal). Buffer indices are 64-bit.
// template: QT (q_lat, q_rot, o_lat), KT (c_kv, k_pe), DL (latent rank r), DR (rope dim), NSG, CAUSAL, HAS_MASK
// inputs:
//   q_lat  [B, H, T, DL]  QT    scaled latent queries
//   q_rot  [B, H, T, DR]  QT    scaled rope queries
//   c_kv   [B, S, DL]     KT    cached latent keys = values
//   k_pe   [B, S, DR]     KT    cached rope keys
//   mask   [B, T, S]      bool  True = may attend (a 1-element placeholder when HAS_MASK is 0); a row
//                             that sees no key gets lse -inf and an undefined o_lat
// outputs:
//   o_lat  [B, H, T, DL]  QT    attention output in latent space (before unembed_out)
//   lse    [B, H, T]      float log sum_s exp(score_s) over the visible keys (-inf when none): merges key segments
// @inputs q_lat q_rot c_kv k_pe mask
// @outputs o_lat lse
// @body
constexpr int EL = (DL + 31) / 32;  // latent dims per lane
constexpr int ER = (DR + 31) / 32;  // rope dims per lane

const uint lane = thread_index_in_simdgroup;
const uint sg = thread_position_in_threadgroup.x / 32;
const uint b = threadgroup_position_in_grid.z;
const int H = q_lat_shape[1];
const int T = q_lat_shape[2];
const int S = c_kv_shape[1];
const int r = threadgroup_position_in_grid.y * NSG + sg;  // t * H + h
if (r >= T * H) {
  return;  // the whole SIMD-group
}
const int t = r / H;
const int h = r % H;
const ulong row = ((ulong)b * H + h) * T + t;
const int end = CAUSAL ? metal::min(S, S - T + t + 1) : S;  // keys past `end` are never visible

float ql[EL];
float qr[ER];
float o[EL];
for (int i = 0; i < EL; ++i) {
  const uint d = lane + 32 * i;
  ql[i] = d < DL ? static_cast<float>(q_lat[row * DL + d]) : 0.0f;
  o[i] = 0.0f;
}
for (int i = 0; i < ER; ++i) {
  const uint d = lane + 32 * i;
  qr[i] = d < DR ? static_cast<float>(q_rot[row * DR + d]) : 0.0f;
}

float m = -INFINITY;  // running max of the visible scores
float l = 0.0f;       // running sum of exp(score - m)
for (int s0 = 0; s0 < end; s0 += 32) {
  const int n = metal::min(32, end - s0);
  float my_score = -INFINITY;  // lane j: score of key s0 + j (-inf when masked)
  for (int j = 0; j < n; ++j) {
    const int s = s0 + j;
    if (HAS_MASK && !mask[((ulong)b * T + t) * S + s]) {
      continue;  // uniform across the SIMD-group
    }
    const ulong key = (ulong)b * S + s;
    float part = 0.0f;
    for (int i = 0; i < EL; ++i) {
      const uint d = lane + 32 * i;
      if (d < DL) {
        part += ql[i] * static_cast<float>(c_kv[key * DL + d]);
      }
    }
    for (int i = 0; i < ER; ++i) {
      const uint d = lane + 32 * i;
      if (d < DR) {
        part += qr[i] * static_cast<float>(k_pe[key * DR + d]);
      }
    }
    const float sc = simd_sum(part);
    if (lane == (uint)j) {
      my_score = sc;
    }
  }
  const float block_max = simd_max(my_score);
  if (block_max == -INFINITY) {
    continue;  // no visible key in this block
  }
  const float m_new = metal::max(m, block_max);
  const float alpha = metal::exp(m - m_new);  // 0 while nothing was seen (m = -inf)
  const float p = metal::exp(my_score - m_new);  // 0 for masked keys
  l = l * alpha + simd_sum(p);
  for (int i = 0; i < EL; ++i) {
    o[i] *= alpha;
  }
  for (int j = 0; j < n; ++j) {
    const float pj = simd_broadcast(p, (ushort)j);
    if (pj == 0.0f) {
      continue;  // uniform: masked (or underflowed) key
    }
    const ulong key = (ulong)b * S + s0 + j;
    for (int i = 0; i < EL; ++i) {
      const uint d = lane + 32 * i;
      if (d < DL) {
        o[i] += pj * static_cast<float>(c_kv[key * DL + d]);
      }
    }
  }
  m = m_new;
}
for (int i = 0; i < EL; ++i) {
  const uint d = lane + 32 * i;
  if (d < DL) {
    o_lat[row * DL + d] = static_cast<QT>(o[i] / l);
  }
}
if (lane == 0) {
  lse[row] = m + metal::log(l);  // -inf when no key was visible (m = -inf, l = 0)
}
