// ggml_matvec: decode mat-vec straight from GGML blocks, y[p, n] = sum_k x[p, k] * W_e[n, k] with e = indices[p]
// (W_e = expert e's rows of ``blocks``, exactly gguf-py's dequantized weights), float32 accumulation. A plain
// weight is E = 1 with indices all 0; the gathered form (MoE decode) reads one [N, row_bytes] slice per pair p.
// grid: (32, N, P)    threadgroup: (32, NSG, 1): one SIMD-group per output y[p, n], NSG rows per threadgroup
//   (MLX dispatches non-uniform threadgroups, so when NSG does not divide N the last one just has fewer
//   SIMD-groups: no thread with n >= N exists). Lane l decodes the 16-weight chunks l, l + 32, ... of the row
//   (chunk c: weights 16 c .. 16 c + 15, as in ggml_dequant), multiplies them with x in float32, and a simd_sum
//   adds the 32 lane sums; lane 0 writes y. No threadgroup memory; matvec_metal caps NSG at N and keeps 32 NSG within
//   kimi_mlx.metal.MAX_THREADS_PER_THREADGROUP. Row, output and pair indices are 64-bit (ulong).
// template: TYPE (gguf GGMLQuantizationType number, as in ggml_dequant), OT (x and y dtype)
// inputs:
//   x       [P, K] OT                   one activation row per pair
//   blocks  [E, N, row_bytes] uint8     the GGUF bytes (row_bytes = K / ELEMS * BYTES)
//   grid, signs, values                 the type's tables or 1-element placeholders (as in ggml_dequant)
//   indices [P] int32                   expert of pair p, in [0, E) (index it directly: < 8 pairs -> constant)
// outputs:
//   y       [P, N] OT
// The weights are gguf-py's bitwise (see ggml_dequant.metal: every product is exact in float32); the dot products
// accumulate per lane (16-weight chunks in order) then across lanes (simd_sum: the GPU's order).
// @inputs x blocks grid signs values indices
// @outputs y
// @include ggml_blocks.h
// @body
using Blk = Block<TYPE>;
constexpr int CPB = Blk::ELEMS / 16;  // 16-weight chunks per block
const int lane = thread_position_in_threadgroup.x;
const ulong n = thread_position_in_grid.y;
const ulong p = thread_position_in_grid.z;
const int K = x_shape[1];
const ulong N = blocks_shape[1];
const int row_bytes = blocks_shape[2];
const device uint8_t* row = blocks + (ulong(indices[p]) * N + n) * row_bytes;
float acc = 0.0f;
for (int c = lane; c < K / 16; c += 32) {
  float w[16];
  Blk::decode16(row + (c / CPB) * Blk::BYTES, c % CPB, grid, signs, values, w);
  for (int j = 0; j < 16; ++j) {
    acc += w[j] * static_cast<float>(x[p * K + 16 * c + j]);
  }
}
acc = simd_sum(acc);
if (lane == 0) {
  y[p * N + n] = static_cast<OT>(acc);
}
