// mla_decode_split: pass 1 of the split-K (flash-decoding) form of mla_decode. The S cached keys of a sequence are
// cut into NS splits of keys_per_split consecutive keys (the last one shorter); one threadgroup takes one split for
// HG = NSG * HPS heads at once, so each latent row of the split is read from device memory once per HG heads (the
// latent c_kv [S, r] is shared by all heads), and writes per (head, split) the unnormalised partial state
//   m = max_s score_s,  l = sum_s exp(score_s - m),  o = sum_s exp(score_s - m) c_kv[s]     (float32)
// over the split's visible keys, with score_s = q_lat . c_kv[s] + q_rot . k_pe[s] as in mla_decode.
// metal_kernels/mla_decode_reduce.metal merges the NS partial states of a row (pass 2).
// grid: (32 * NSG, ceil(H / HG), B * NS)    threadgroup: (32 * NSG, 1, 1)
//   threadgroup (g, b * NS + j): heads g HG ... g HG + HG - 1 (those < H), keys [j KPS, min(S, (j + 1) KPS)).
//   The split's keys go through threadgroup memory TK at a time: all 32 NSG threads copy a tile of TK latent and rope
//   rows (contiguous, coalesced), a barrier, then SIMD-group sg scores the tile for its HPS heads sg HPS + k (lane i
//   owns latent dims i, i + 32, ...; the lanes' partial dots of the TK keys are summed by one reduce-scatter, after
//   which lanes j 32 / TK ... (j + 1) 32 / TK - 1 hold key j's score), updates each head's online softmax (running
//   max / sum / output in registers) and accumulates the tile's rows weighted by the probabilities (broadcast from
//   a lane holding each key); a second barrier before the next tile overwrites the buffers.
//   Threadgroup memory: KT tile_c[TK * DL], tile_r[TK * DR], i.e. sizeof(KT) TK (DL + DR) bytes (9,216 at
//   DL = 512, DR = 64, TK = 8, KT = bfloat16). Registers per thread: HPS (2 EL + ER + 2) + TK floats, EL = DL / 32,
//   ER = DR / 32 (80 at r = 512, rope 64, HPS = 2, TK = 8). Both, and 32 NSG threads, are checked by the host
//   (kimi_mlx/ops/mla_attention_metal.py). Buffer offsets are 64-bit; ints hold positions along one axis.
// template: QT (q_lat, q_rot), KT (c_kv, k_pe), DL, DR, NSG, HPS (heads per SIMD-group), TK (keys per tile, a power
//   of two <= 32), HAS_MASK
// inputs:
//   q_lat  [B, H, DL]  QT     scaled latent queries
//   q_rot  [B, H, DR]  QT     scaled rope queries
//   c_kv   [B, S, DL]  KT     cached latent keys = values
//   k_pe   [B, S, DR]  KT     cached rope keys
//   mask   [B, S]      bool   True = may attend (a 1-element placeholder when HAS_MASK is 0)
//   keys_per_split     int32  KPS; NS = ceil(S / KPS) = grid z / B, so no split is empty
// outputs (float32):
//   o_part [B, H, NS, DL]     sum_s exp(score_s - m) c_kv[s] over the split's visible keys (0 when none)
//   m_part [B, H, NS]         max of the split's visible scores (-inf when none)
//   l_part [B, H, NS]         sum_s exp(score_s - m) (0 when none)
// @inputs q_lat q_rot c_kv k_pe mask keys_per_split
// @outputs o_part m_part l_part
// @body
constexpr int EL = (DL + 31) / 32;  // latent dims per lane
constexpr int ER = (DR + 31) / 32;  // rope dims per lane
constexpr int NT = 32 * NSG;        // threads per threadgroup
constexpr int SH = TK == 32 ? 0 : TK == 16 ? 1 : TK == 8 ? 2 : TK == 4 ? 3 : TK == 2 ? 4 : 5;  // log2(32 / TK)
static_assert(TK == 32 || TK == 16 || TK == 8 || TK == 4 || TK == 2 || TK == 1, "TK: a power of two <= 32");
threadgroup KT tile_c[TK * DL];
threadgroup KT tile_r[TK * DR];

const uint tid = thread_position_in_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint sg = tid / 32;
const int B = q_lat_shape[0];
const int H = q_lat_shape[1];
const int S = c_kv_shape[1];
const uint NS = threadgroups_per_grid.z / B;
const uint b = threadgroup_position_in_grid.z / NS;
const uint j = threadgroup_position_in_grid.z % NS;
const int s_begin = int(j) * keys_per_split;
const int s_end = metal::min(S, s_begin + keys_per_split);
const int h0 = (int(threadgroup_position_in_grid.y) * NSG + int(sg)) * HPS;  // this SIMD-group's first head

float ql[HPS][EL];
float qr[HPS][ER];
float o[HPS][EL];
float m[HPS];  // running max of head k's visible scores
float l[HPS];  // running sum of exp(score - m)
for (int k = 0; k < HPS; ++k) {
  const ulong row = (ulong)b * H + metal::min(h0 + k, H - 1);  // a head past H reads a valid row, writes nothing
  for (int i = 0; i < EL; ++i) {
    const uint d = lane + 32 * i;
    ql[k][i] = d < DL ? static_cast<float>(q_lat[row * DL + d]) : 0.0f;
    o[k][i] = 0.0f;
  }
  for (int i = 0; i < ER; ++i) {
    const uint d = lane + 32 * i;
    qr[k][i] = d < DR ? static_cast<float>(q_rot[row * DR + d]) : 0.0f;
  }
  m[k] = -INFINITY;
  l[k] = 0.0f;
}

for (int t0 = s_begin; t0 < s_end; t0 += TK) {
  const int n = metal::min(TK, s_end - t0);
  const ulong first = (ulong)b * S + t0;  // the tile's first key in [B, S]
  for (int e = int(tid); e < n * DL; e += NT) {
    tile_c[e] = c_kv[first * DL + e];
  }
  for (int e = int(tid); e < n * DR; e += NT) {
    tile_r[e] = k_pe[first * DR + e];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int k = 0; k < HPS; ++k) {
    if (h0 + k >= H) {
      break;  // uniform across the SIMD-group
    }
    // Each lane's partial dots of the tile's keys, then one reduce-scatter across the SIMD-group (recursive halving:
    // at lane offset 16, 8, ... a lane keeps the half of its keys its offset bit selects and adds its partner's
    // partials of that half), TK - 1 + log2(32 / TK) shuffles per tile where a simd_sum per key takes 5 TK.
    // Afterwards lane L holds the full score of key L >> SH (each key on 32 / TK lanes).
    float v[TK];
    for (int jj = 0; jj < TK; ++jj) {
      float part = 0.0f;
      if (jj < n) {  // rows past n were not loaded
        for (int i = 0; i < EL; ++i) {
          const uint d = lane + 32 * i;
          if (d < DL) {
            part += ql[k][i] * static_cast<float>(tile_c[jj * DL + d]);
          }
        }
        for (int i = 0; i < ER; ++i) {
          const uint d = lane + 32 * i;
          if (d < DR) {
            part += qr[k][i] * static_cast<float>(tile_r[jj * DR + d]);
          }
        }
      }
      v[jj] = part;
    }
    int width = TK;  // keys still held per lane
    for (ushort off = 16; off >= 1; off >>= 1) {
      if (width > 1) {
        const int hw = width / 2;
        const bool upper = (lane & off) != 0;
        for (int i = 0; i < hw; ++i) {
          const float keep = upper ? v[hw + i] : v[i];
          const float give = upper ? v[i] : v[hw + i];
          v[i] = keep + simd_shuffle_xor(give, off);
        }
        width = hw;
      } else {
        v[0] += simd_shuffle_xor(v[0], off);
      }
    }
    const int key = int(lane >> SH);  // the tile key whose score this lane holds
    const bool visible = key < n && (!HAS_MASK || mask[first + key]);
    const float my_score = visible ? v[0] : -INFINITY;
    const float tile_max = simd_max(my_score);
    if (tile_max == -INFINITY) {
      continue;  // no visible key in this tile
    }
    const float m_new = metal::max(m[k], tile_max);
    const float alpha = metal::exp(m[k] - m_new);  // 0 while nothing was seen (m = -inf)
    const float p = metal::exp(my_score - m_new);  // 0 for masked keys and lanes past n
    l[k] = l[k] * alpha + simd_sum((lane & ((1u << SH) - 1)) == 0 ? p : 0.0f);  // each key once
    for (int i = 0; i < EL; ++i) {
      o[k][i] *= alpha;
    }
    for (int jj = 0; jj < n; ++jj) {
      const float pj = simd_broadcast(p, (ushort)(jj << SH));
      if (pj == 0.0f) {
        continue;  // uniform: masked (or underflowed) key
      }
      for (int i = 0; i < EL; ++i) {
        const uint d = lane + 32 * i;
        if (d < DL) {
          o[k][i] += pj * static_cast<float>(tile_c[jj * DL + d]);
        }
      }
    }
    m[k] = m_new;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // the tile is read by all before the next one overwrites it
}

for (int k = 0; k < HPS; ++k) {
  if (h0 + k >= H) {
    break;
  }
  const ulong prow = ((ulong)b * H + h0 + k) * NS + j;  // (b, head, split) in [B, H, NS]
  for (int i = 0; i < EL; ++i) {
    const uint d = lane + 32 * i;
    if (d < DL) {
      o_part[prow * DL + d] = o[k][i];
    }
  }
  if (lane == 0) {
    m_part[prow] = m[k];
    l_part[prow] = l[k];
  }
}
