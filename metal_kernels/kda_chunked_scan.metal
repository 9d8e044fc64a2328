// KDA chunked prefill: the part that is sequential across chunks (inter-chunk state recurrence + outputs), on the
// SIMD-group matrix units. Body for mx.fast.metal_kernel; host side: kimi_mlx/ops/kda_chunked_metal.py. The
// intra-chunk quantities come from metal_kernels/kda_chunked_prep.metal (same values as kimi_mlx.ops.kda._intra_chunk),
// where every decay factor was formed from exponents <= 0 (safe at g = -1000); this kernel only multiplies and adds.
//
// Per chunk n of C tokens, per (b, h), fla orientation S[Dk, Dv]:
//   WS = WQ @ S;  Vnew = UO[:C] - WS[:C];  O = UO[C:] + WS[C:];  S <- diag(decay) S + Kg^T @ Vnew
// Columns of S are independent: one SIMD-group per (b, h, 8-column tile of Dv) keeps its S[Dk, 8] in registers as
// Dk/8 float 8x8 simdgroup matrices and does every product above as 8x8x8 multiply-accumulates (float32). Lane
// layout of an 8x8 matrix (MLX steel's BaseMMAFrag::get_coord): lane l holds row (l/4 & 4) + (l/2) % 4, columns
// (l/4 & 2) * 2 + (l % 2) * 2 and +1, as thread_elements()[0] and [1]. Transposed blocks (the state, Kg^T) are read
// and written lane by lane through that layout; other tiles use plain row-major simdgroup_load from an offset pointer
// (no matrix_origin / transpose_matrix). No threadgroup memory, no barriers.
// Pointers into buffers are `auto`, so they keep each buffer's address space (mask may be `constant`: < 8 elements).
//
// Grid (32, Dv / 8, B * H); threadgroup (32, SG, 1) for any SG (SIMD-groups of independent tiles; edge groups partial);
// kda_chunked_metal caps SG at Dv / 8 and keeps 32 SG within kimi_mlx.metal.MAX_THREADS_PER_THREADGROUP. Buffer
// offsets are 64-bit (size_t).
// Template: OutT (output dtype), C (chunk size, a multiple of 8), Dk, Dv, H (ints; Dk, Dv multiples of 8).
// Inputs (float32 unless noted; N = ceil(T / C) chunks, chunk-major, as kda_chunked_prep writes them):
//   wq       [N, B, H, 2C, Dk]  [W; Q*exp(G) - Aqk W]
//   uo       [N, B, H, 2C, Dv]  [U; Aqk U]
//   kg       [N, B, H, C, Dk]   K * exp(G_C - G)
//   decay    [N, B, H, Dk]      exp(G_C)
//   state_in [B, H, Dv, Dk]     initial state (mlx-lm orientation, i.e. S^T)
//   mask     [B, T] bool        True = real token (false: output 0; its step is an identity on the state)
//   T        int32 scalar       tokens (the last chunk may be partial; its padded rows are not written)
// Outputs:
//   o         [B, T, H, Dv] OutT
//   state_out [B, H, Dv, Dk] float32
// @inputs wq uo kg decay state_in mask T
// @outputs o state_out

constexpr int KB = Dk / 8;  // 8-row blocks of S
constexpr int RB = C / 8;   // 8-row blocks of a chunk
const uint lane = thread_position_in_threadgroup.x;
const uint v0 = thread_position_in_grid.y * 8;  // first Dv column of this SIMD-group's tile
const uint bh = thread_position_in_grid.z;
const uint BH = threads_per_grid.z;
const uint b = bh / H;
const uint h = bh % H;
const int n_chunks = (T + C - 1) / C;
// This lane's two elements of any 8x8 matrix: (row, col) and (row, col + 1).
const int row = ((lane / 4) & 4) + (lane / 2) % 4;
const int col = ((lane / 4) & 2) * 2 + (lane % 2) * 2;

// S[kb] = S[kb*8 .. +8, v0 .. +8] = state_in[v0 .. +8, kb*8 .. +8]^T: this lane's (row, col + e) is
// state_in[v0 + col + e, kb*8 + row].
auto st_in = state_in + (size_t(bh) * Dv + v0 + col) * Dk + row;
simdgroup_float8x8 s[KB];
for (int kb = 0; kb < KB; ++kb) {
  s[kb].thread_elements()[0] = st_in[kb * 8];
  s[kb].thread_elements()[1] = st_in[Dk + kb * 8];
}

simdgroup_float8x8 vnew[RB];
simdgroup_float8x8 a;
simdgroup_float8x8 acc;
for (int n = 0; n < n_chunks; ++n) {
  const size_t cb = size_t(n) * BH + bh;
  auto wq_ = wq + cb * (2 * C * Dk);
  auto uo_ = uo + cb * (2 * C * Dv);
  auto kg_ = kg + cb * (C * Dk);
  auto decay_ = decay + cb * Dk;

  // Vnew = U - W S (row blocks 0 .. RB-1 of WQ / UO).
  for (int rb = 0; rb < RB; ++rb) {
    acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (int kb = 0; kb < KB; ++kb) {
      simdgroup_load(a, wq_ + rb * 8 * Dk + kb * 8, Dk);
      simdgroup_multiply_accumulate(acc, a, s[kb], acc);
    }
    simdgroup_load(vnew[rb], uo_ + rb * 8 * Dv + v0, Dv);
    vnew[rb].thread_elements()[0] -= acc.thread_elements()[0];
    vnew[rb].thread_elements()[1] -= acc.thread_elements()[1];
  }

  // O = Aqk U + (Q exp(G) - Aqk W) S (row blocks RB .. 2RB-1), written for real rows only.
  for (int rb = 0; rb < RB; ++rb) {
    simdgroup_load(acc, uo_ + (C + rb * 8) * Dv + v0, Dv);
    for (int kb = 0; kb < KB; ++kb) {
      simdgroup_load(a, wq_ + (C + rb * 8) * Dk + kb * 8, Dk);
      simdgroup_multiply_accumulate(acc, a, s[kb], acc);
    }
    const int t = n * C + rb * 8 + row;
    if (t < T) {
      const bool live = mask[size_t(b) * T + t];
      auto o_ = o + ((size_t(b) * T + t) * H + h) * Dv + v0 + col;
      o_[0] = static_cast<OutT>(live ? float(acc.thread_elements()[0]) : 0.0f);
      o_[1] = static_cast<OutT>(live ? float(acc.thread_elements()[1]) : 0.0f);
    }
  }

  // S <- diag(exp(G_C)) S + Kg^T Vnew (each lane loads its two elements of a Kg^T block itself).
  for (int kb = 0; kb < KB; ++kb) {
    const float d = decay_[kb * 8 + row];
    s[kb].thread_elements()[0] *= d;
    s[kb].thread_elements()[1] *= d;
    for (int rb = 0; rb < RB; ++rb) {
      a.thread_elements()[0] = kg_[(rb * 8 + col) * Dk + kb * 8 + row];
      a.thread_elements()[1] = kg_[(rb * 8 + col + 1) * Dk + kb * 8 + row];
      simdgroup_multiply_accumulate(s[kb], a, vnew[rb], s[kb]);
    }
  }
}

auto st_out = state_out + (size_t(bh) * Dv + v0 + col) * Dk + row;
for (int kb = 0; kb < KB; ++kb) {
  st_out[kb * 8] = s[kb].thread_elements()[0];
  st_out[Dk + kb * 8] = s[kb].thread_elements()[1];
}
