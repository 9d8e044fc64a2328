// KDA chunked prefill, intra-chunk part: everything of a chunk that does not depend on the carried state, i.e. what
// kimi_mlx.ops.kda_chunked.intra_chunk computes, for one chunk per threadgroup, straight from the [B, T, H, D] inputs.
// Its outputs feed metal_kernels/kda_chunked_scan.metal; host side: kimi_mlx/ops/kda_chunked_metal.py.
//
// Chunk tokens t = t0 + n*C + i (i < C). Tokens at t >= t1 are padding (q = k = v = 0, g = 0, beta = 0) and masked
// tokens (mask false) get g = 0, beta = 0: both are identity steps on the state, as in the pure path.
// Decays are never exp of a difference of cumulative sums: exp(G_i - G_j) = prod_{j < t <= i} alpha_t (alpha = exp(g))
// is a running product of factors <= 1 anchored at row i, and exp(G_i), exp(G_C - G_j) are prefix / suffix products,
// so g = -1000 gives exact zeros and nothing overflows or cancels.
//   Aqk[i, j] = sum_c q_ic k_jc exp(G_ic - G_jc) (j <= i);  Akk[i, j] = beta_i sum_c k_ic k_jc exp(G_ic - G_jc) (j < i)
//   Lb = (I + Akk)^-1 diag(beta) (forward substitution);  M = Aqk Lb;  X = K exp(G)
//   wq = [Lb X; Q exp(G) - M X];  uo = [Lb V; M V];  kg = K exp(G_C - G);  decay = exp(G_C)
//
// Grid (32 * SG, N, B * H), N = ceil((t1 - t0) / C); threadgroup (32 * SG, 1, 1): SG SIMD-groups per (chunk, b, h).
// The chunk's working rows live in threadgroup memory and every output element is written to device memory once
// (no output is read back). Dk is walked in slabs of BK channels (BK | Dk): a slab of q, k and alpha rows ([C, BK]
// each) is staged from device memory, by all threads with consecutive threads on consecutive channels.
//   1. Per slab: Aqk / Akk accumulated in threadgroup memory; SIMD-group s owns rows i = s, s + SG, ..., its lanes
//      split the slab's channels and simd_sum each (i, j).
//   2. Lb by forward substitution (lane j of SIMD-group 0 owns column j);  3. M = Aqk Lb on 8x8 SIMD-group matrices.
//   4. Per slab (restaged only when Dk has more than one slab): the thread owning a channel turns its k / q columns
//      into X / Q exp(G) in place and writes kg, decay; then 8x8 tiles of wq (both halves of a row block and column
//      block per job) are spread over the SIMD-groups, read from threadgroup memory, stored to device memory.
//   5. Per slab of BV channels of v (staged into the same buffer): tiles of uo = [Lb V; M V] likewise.
// A threadgroup_barrier separates every write of a threadgroup array from reads by other threads (and every read
// from the next overwrite). Rows of the threadgroup arrays are padded by 4 floats (LDC = C + 4, LDS = BK + 4,
// LDV = BV + 4): assuming 32 four-byte banks, the 8 rows of an 8x8 tile then start on 8 different multiples of 4
// banks and a tile load touches each bank twice, the least 64 floats can (unpadded, rows of 32 or 128 floats would
// put all 8 rows on the same 8 banks, rows of 16 on two sets of 8). Threadgroup memory, floats:
// 3 C LDC (aqk, akk_m, lb) + C (beta) + 3 C LDS (the slab); kda_chunked_metal.prep_threadgroup_bytes is the same
// formula. At Dk = Dv = 128: C = 8, BK = 128: 13,856 bytes; C = 16, BK = 128: 29,248 bytes; C = 32, BK = 32:
// 27,776 bytes (within Metal's 32 KB).
// Buffer offsets are 64-bit (size_t); ints hold positions along one axis (tokens < 2^31).
// Template: QT, KT, VT (q, k, v dtypes), C (8, 16 or 32), Dk, Dv, H, SG (SIMD-groups), BK (a multiple of 32
// dividing Dk), BV (a multiple of 8 dividing Dv, at most 3 BK: C LDV <= 3 C LDS).
// Inputs:
//   q, k  [B, T, H, Dk] QT, KT   q L2-normalised and pre-scaled by Dk^-0.5, k L2-normalised
//   v     [B, T, H, Dv] VT
//   g     [B, T, H, Dk] float32  per-channel log-decay (<= 0)
//   beta  [B, T, H] float32
//   mask  [B, T] bool            True = real token
//   T, t0, t1  int32 scalars     sequence length; this launch covers tokens [t0, t1)
// Outputs (float32, chunk-major like kda_chunked.intra_chunk's output):
//   wq [N, B, H, 2C, Dk];  uo [N, B, H, 2C, Dv];  kg [N, B, H, C, Dk];  decay [N, B, H, Dk]
// @inputs q k v g beta mask T t0 t1
// @outputs wq uo kg decay

constexpr int NT = 32 * SG;    // threads per threadgroup
constexpr int RB = C / 8;      // 8-row blocks of a chunk
constexpr int NL = BK / 32;    // channels of a slab per lane (step 1)
constexpr int LDC = C + 4;     // row strides (floats) of the C x C arrays, the slab, the v slab
constexpr int LDS = BK + 4;
constexpr int LDV = BV + 4;
constexpr int QS = 0;          // slab offsets in `slab`: q rows [C, LDS], then k rows, then alpha rows
constexpr int KS = C * LDS;
constexpr int AS = 2 * C * LDS;
threadgroup float aqk[C * LDC];    // Aqk (zero above the diagonal)
threadgroup float akk_m[C * LDC];  // Akk (zero on and above the diagonal), then M = Aqk Lb
threadgroup float lb[C * LDC];     // Lb = (I + Akk)^-1 diag(beta)
threadgroup float bet[C];          // beta, 0 at masked and padding tokens
threadgroup float slab[3 * C * LDS];

const uint tid = thread_position_in_threadgroup.x;
const uint sg = tid / 32;
const uint lane = tid % 32;
const uint n = thread_position_in_grid.y;
const uint bh = thread_position_in_grid.z;
const uint BH = threads_per_grid.z;
const uint b = bh / H;
const uint h = bh % H;
const int ts = t0 + int(n) * C;  // first token of the chunk
const size_t cb = size_t(n) * BH + bh;
const size_t row_k = size_t(H) * Dk;  // elements between tokens of q / k / g
const size_t row_v = size_t(H) * Dv;

auto q_ = q + (size_t(b) * T * H + h) * Dk;  // token t, channel c: q_[t * row_k + c]
auto k_ = k + (size_t(b) * T * H + h) * Dk;
auto g_ = g + (size_t(b) * T * H + h) * Dk;
auto v_ = v + (size_t(b) * T * H + h) * Dv;
auto beta_ = beta + size_t(b) * T * H + h;
auto mask_ = mask + size_t(b) * T;
auto wq_ = wq + cb * (2 * C * Dk);
auto uo_ = uo + cb * (2 * C * Dv);
auto kg_ = kg + cb * (C * Dk);
auto decay_ = decay + cb * Dk;

for (uint e = tid; e < C * LDC; e += NT) {
  aqk[e] = 0.0f;
  akk_m[e] = 0.0f;
}
if (tid < C) {
  const int t = ts + int(tid);
  bet[tid] = (t < t1 && mask_[t]) ? float(beta_[size_t(t) * H]) : 0.0f;
}

simdgroup_float8x8 lt;
simdgroup_float8x8 rt;
simdgroup_float8x8 acc0;
simdgroup_float8x8 acc1;

// pass 0: steps 1-3 (Aqk and Akk over every slab, then Lb and M); pass 1: step 4, slab by slab.
for (int pass = 0; pass < 2; ++pass) {
  for (int s0 = 0; s0 < Dk; s0 += BK) {
    if (pass == 0 || Dk > BK) {
      // Stage the slab: rows m < C, channels s0 .. s0 + BK.
      for (uint e = tid; e < C * BK; e += NT) {
        const int m = e / BK;
        const int c = e % BK;
        const int t = ts + m;
        const bool valid = t < t1;
        const bool live = valid && mask_[t];
        const size_t at = size_t(valid ? t : 0) * row_k + s0 + c;
        slab[QS + m * LDS + c] = valid ? float(q_[at]) : 0.0f;
        slab[KS + m * LDS + c] = valid ? float(k_[at]) : 0.0f;
        slab[AS + m * LDS + c] = live ? metal::exp(g_[at]) : 1.0f;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    if (pass == 0) {
      // 1. This slab's share of rows i of Aqk / Akk; r = exp(G_i - G_j) as a running product over j < i.
      for (int i = sg; i < C; i += SG) {
        float qi[NL];
        float ki[NL];
        float r[NL];
        float p = 0.0f;
        for (int c = 0; c < NL; ++c) {
          qi[c] = slab[QS + i * LDS + c * 32 + lane];
          ki[c] = slab[KS + i * LDS + c * 32 + lane];
          r[c] = 1.0f;
          p += qi[c] * ki[c];
        }
        p = simd_sum(p);
        if (lane == 0) {
          aqk[i * LDC + i] += p;
        }
        const float bi = bet[i];
        for (int j = i - 1; j >= 0; --j) {
          float pq = 0.0f;
          float pk = 0.0f;
          for (int c = 0; c < NL; ++c) {
            r[c] *= slab[AS + (j + 1) * LDS + c * 32 + lane];
            const float kr = slab[KS + j * LDS + c * 32 + lane] * r[c];
            pq += qi[c] * kr;
            pk += ki[c] * kr;
          }
          pq = simd_sum(pq);
          pk = simd_sum(pk);
          if (lane == 0) {
            aqk[i * LDC + j] += pq;
            akk_m[i * LDC + j] += bi * pk;
          }
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);  // rows read by other SIMD-groups; slab restaged next
    } else {
      // 4. The thread owning channel c: kg = k exp(G_C - G) (suffix products), then X = k exp(G), q exp(G) in place.
      for (uint c = tid; c < BK; c += NT) {
        float gam = 1.0f;
        for (int m = C - 1; m >= 0; --m) {
          kg_[m * Dk + s0 + c] = slab[KS + m * LDS + c] * gam;
          gam *= slab[AS + m * LDS + c];
        }
        gam = 1.0f;
        for (int m = 0; m < C; ++m) {
          gam *= slab[AS + m * LDS + c];
          slab[KS + m * LDS + c] *= gam;
          slab[QS + m * LDS + c] *= gam;
        }
        decay_[s0 + c] = gam;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);  // tiles below span channels of several threads
      // Row block rb, column block cj of both halves: W = Lb X, Q exp(G) - M X (lower-triangular Lb, M).
      for (int job = sg; job < RB * (BK / 8); job += SG) {
        const int rb = job / (BK / 8);
        const int cj = job % (BK / 8);
        acc0 = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        acc1 = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        for (int mb = 0; mb <= rb; ++mb) {
          simdgroup_load(rt, slab + KS + mb * 8 * LDS + cj * 8, LDS);
          simdgroup_load(lt, lb + rb * 8 * LDC + mb * 8, LDC);
          simdgroup_multiply_accumulate(acc0, lt, rt, acc0);
          simdgroup_load(lt, akk_m + rb * 8 * LDC + mb * 8, LDC);
          simdgroup_multiply_accumulate(acc1, lt, rt, acc1);
        }
        simdgroup_store(acc0, wq_ + rb * 8 * Dk + s0 + cj * 8, Dk);
        simdgroup_load(lt, slab + QS + rb * 8 * LDS + cj * 8, LDS);
        lt.thread_elements()[0] -= acc1.thread_elements()[0];
        lt.thread_elements()[1] -= acc1.thread_elements()[1];
        simdgroup_store(lt, wq_ + (C + rb * 8) * Dk + s0 + cj * 8, Dk);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);  // the slab is overwritten next
    }
  }
  if (pass == 0) {
    // 2. Lb column j = (I + Akk)^-1 (beta_j e_j), lane j of SIMD-group 0 (writes the whole column, zeros above j).
    if (tid < C) {
      const int j = tid;
      for (int i = 0; i < C; ++i) {
        float x = i == j ? bet[j] : 0.0f;
        for (int m = j; m < i; ++m) {
          x -= akk_m[i * LDC + m] * lb[m * LDC + j];
        }
        lb[i * LDC + j] = x;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // 3. M = Aqk Lb into akk_m (Akk is no longer read), lower 8x8 tiles spread over the SIMD-groups; the tiles above
    //    the diagonal keep Akk's zeros.
    for (int job = sg; job < RB * RB; job += SG) {
      const int rb = job / RB;
      const int cj = job % RB;
      if (cj > rb) {
        continue;
      }
      acc0 = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      for (int mb = cj; mb <= rb; ++mb) {
        simdgroup_load(lt, aqk + rb * 8 * LDC + mb * 8, LDC);
        simdgroup_load(rt, lb + mb * 8 * LDC + cj * 8, LDC);
        simdgroup_multiply_accumulate(acc0, lt, rt, acc0);
      }
      simdgroup_store(acc0, akk_m + rb * 8 * LDC + cj * 8, LDC);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

// 5. uo = [Lb V; M V], slab by slab of BV channels of v staged into `slab` ([C, LDV]).
for (int s0 = 0; s0 < Dv; s0 += BV) {
  for (uint e = tid; e < C * BV; e += NT) {
    const int m = e / BV;
    const int c = e % BV;
    const int t = ts + m;
    slab[m * LDV + c] = t < t1 ? float(v_[size_t(t) * row_v + s0 + c]) : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int job = sg; job < RB * (BV / 8); job += SG) {
    const int rb = job / (BV / 8);
    const int cj = job % (BV / 8);
    acc0 = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    acc1 = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (int mb = 0; mb <= rb; ++mb) {
      simdgroup_load(rt, slab + mb * 8 * LDV + cj * 8, LDV);
      simdgroup_load(lt, lb + rb * 8 * LDC + mb * 8, LDC);
      simdgroup_multiply_accumulate(acc0, lt, rt, acc0);
      simdgroup_load(lt, akk_m + rb * 8 * LDC + mb * 8, LDC);
      simdgroup_multiply_accumulate(acc1, lt, rt, acc1);
    }
    simdgroup_store(acc0, uo_ + rb * 8 * Dv + s0 + cj * 8, Dv);
    simdgroup_store(acc1, uo_ + (C + rb * 8) * Dv + s0 + cj * 8, Dv);
  }
  if (s0 + BV < Dv) {
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the slab is overwritten next
  }
}
