// mla_decode: absorbed MLA attention for one query per (sequence, head) against S cached latent positions
// (a decode step), in latent space with one key/value "head" shared by all heads:
//   score_s = q_lat . c_kv[s] + q_rot . k_pe[s]        (q_lat = embed_q(q_nope) * scale, q_rot = q_pe * scale)
//   o_lat   = sum_s softmax_s(score) * c_kv[s]          over the visible keys (mask[s], all when HAS_MASK is 0)
// with an online softmax (running max / sum / output, float32) over blocks of 32 keys.
// grid: (32 * NSG, H, B)    threadgroup: (32 * NSG, 1, 1): one threadgroup per (b, h) query row.
//   SIMD-group g visits key blocks g, g + NSG, g + 2 NSG, ... (32 keys each): lane j of a block holds key j's score
//   (a simd_sum of the lanes' partial dots; lane i owns latent dims i, i + 32, ...), the block's probabilities are
//   broadcast lane by lane into the per-lane output. The NSG partial (max, sum, output) states are then merged in
//   threadgroup memory and every thread writes output dims tid, tid + 32 NSG, ...
//   Threadgroup memory: float sg_max[NSG], sg_sum[NSG], sg_out[NSG * DL], i.e. 4 NSG (DL + 2) bytes, within 32 KB
//   (at DL = 512: NSG <= 15); 32 NSG threads within kimi_mlx.metal.MAX_THREADS_PER_THREADGROUP. Both are checked by
//   mla_latent_attention_metal. Buffer indices are 64-bit.
// template: QT (q_lat, q_rot, o_lat), KT (c_kv, k_pe), DL (latent rank r), DR (rope dim), NSG, HAS_MASK
// inputs:
//   q_lat  [B, H, DL]  QT    scaled latent queries
//   q_rot  [B, H, DR]  QT    scaled rope queries
//   c_kv   [B, S, DL]  KT    cached latent keys = values
//   k_pe   [B, S, DR]  KT    cached rope keys
//   mask   [B, S]      bool  True = may attend (a 1-element placeholder when HAS_MASK is 0); a row
//                          that sees no key gets lse -inf and an undefined o_lat
// outputs:
//   o_lat  [B, H, DL]  QT    attention output in latent space (before unembed_out)
//   lse    [B, H]      float log sum_s exp(score_s) over the visible keys (-inf when none): merges key segments
// @inputs q_lat q_rot c_kv k_pe mask
// @outputs o_lat lse
// @body
constexpr int EL = (DL + 31) / 32;  // latent dims per lane
constexpr int ER = (DR + 31) / 32;  // rope dims per lane
threadgroup float sg_max[NSG];
threadgroup float sg_sum[NSG];
threadgroup float sg_out[NSG * DL];

const uint tid = thread_position_in_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint sg = tid / 32;
const uint h = threadgroup_position_in_grid.y;
const uint b = threadgroup_position_in_grid.z;
const uint H = threadgroups_per_grid.y;
const int S = c_kv_shape[1];
const ulong row = (ulong)b * H + h;

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

float m = -INFINITY;  // running max of this SIMD-group's visible scores
float l = 0.0f;       // running sum of exp(score - m)
for (int s0 = 32 * sg; s0 < S; s0 += 32 * NSG) {
  const int n = metal::min(32, S - s0);
  float my_score = -INFINITY;  // lane j: score of key s0 + j (-inf when masked)
  for (int j = 0; j < n; ++j) {
    const ulong key = (ulong)b * S + s0 + j;
    if (HAS_MASK && !mask[key]) {
      continue;  // uniform across the SIMD-group
    }
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

// merge the NSG partial states
if (lane == 0) {
  sg_max[sg] = m;
  sg_sum[sg] = l;
}
for (int i = 0; i < EL; ++i) {
  const uint d = lane + 32 * i;
  if (d < DL) {
    sg_out[sg * DL + d] = o[i];
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
float top = sg_max[0];
for (int g = 1; g < NSG; ++g) {
  top = metal::max(top, sg_max[g]);
}
float w[NSG];
float total = 0.0f;
for (int g = 0; g < NSG; ++g) {
  w[g] = metal::exp(sg_max[g] - top);  // 0 for SIMD-groups that saw no visible key
  total += w[g] * sg_sum[g];
}
for (uint d = tid; d < DL; d += 32 * NSG) {
  float acc = 0.0f;
  for (int g = 0; g < NSG; ++g) {
    acc += w[g] * sg_out[g * DL + d];
  }
  o_lat[row * DL + d] = static_cast<QT>(acc / total);
}
if (tid == 0) {
  lse[row] = top == -INFINITY ? -INFINITY : top + metal::log(total);
}
