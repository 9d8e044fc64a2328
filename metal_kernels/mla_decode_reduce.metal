// mla_decode_reduce: pass 2 of the split-K mla_decode: merges a row's NS partial softmax states (from
// metal_kernels/mla_decode_split.metal, or several launches of it concatenated along the split axis, one per key
// segment) with the online-softmax rescale:
//   top = max_j m_j,  w_j = exp(m_j - top) (0 for a split without visible keys, m_j = -inf),
//   o_lat = sum_j w_j o_j / sum_j w_j l_j,  lse = top + log(sum_j w_j l_j)
// grid: (32 * NSG, H, B)    threadgroup: (32 * NSG, 1, 1): one threadgroup per (b, h) row; every thread reads the
//   NS (m, l) pairs itself (no threadgroup memory, no barrier) and owns output dims tid, tid + 32 NSG, ...
//   (ED = ceil(DL / (32 NSG)) registers).
// template: QT (o_lat), DL, NSG
// inputs (float32):
//   o_part [B, H, NS, DL]   m_part [B, H, NS]   l_part [B, H, NS]
// outputs:
//   o_lat  [B, H, DL]  QT     attention output in latent space; a row whose splits saw no key gets lse -inf and an
//                             undefined o_lat (as mla_decode)
//   lse    [B, H]      float  log sum_s exp(score_s) over all visible keys of the row (-inf when none)
// @inputs o_part m_part l_part
// @outputs o_lat lse
// @body
constexpr int NT = 32 * NSG;
constexpr int ED = (DL + NT - 1) / NT;  // output dims per thread

const uint tid = thread_position_in_threadgroup.x;
const uint h = threadgroup_position_in_grid.y;
const uint b = threadgroup_position_in_grid.z;
const uint H = threadgroups_per_grid.y;
const int NS = m_part_shape[2];
const ulong row = (ulong)b * H + h;

float top = -INFINITY;
for (int j = 0; j < NS; ++j) {
  top = metal::max(top, m_part[row * NS + j]);
}
float total = 0.0f;
float acc[ED];
for (int e = 0; e < ED; ++e) {
  acc[e] = 0.0f;
}
for (int j = 0; j < NS; ++j) {
  const float w = metal::exp(m_part[row * NS + j] - top);  // 0 for splits that saw no visible key
  total += w * l_part[row * NS + j];
  for (int e = 0; e < ED; ++e) {
    const uint d = tid + NT * e;
    if (d < DL) {
      acc[e] += w * o_part[(row * NS + j) * DL + d];
    }
  }
}
for (int e = 0; e < ED; ++e) {
  const uint d = tid + NT * e;
  if (d < DL) {
    o_lat[row * DL + d] = static_cast<QT>(acc[e] / total);
  }
}
if (tid == 0) {
  lse[row] = top == -INFINITY ? -INFINITY : top + metal::log(total);
}
