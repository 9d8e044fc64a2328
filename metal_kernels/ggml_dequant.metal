// ggml_dequant: GGML block rows -> float rows, exactly gguf-py's dequantization (gguf.quants.dequantize):
//   out[r, k] = weight k of row r of ``blocks`` (a row is cols / ELEMS blocks of BYTES bytes, the GGUF bytes).
// grid: (cols / 16, rows, 1)    threadgroup: (TX, TY, 1), any shape (no synchronisation, no threadgroup memory):
//   thread (c, r) decodes the 16 consecutive weights 16 c .. 16 c + 15 of row r (chunk c % (ELEMS / 16) of block
//   c / (ELEMS / 16)) into registers and writes them. dequantize_metal launches TX = min(cols / 16, 256), TY =
//   256 / TX: at most 256 threads. Row and output indices are 64-bit (ulong).
// template: TYPE (the gguf GGMLQuantizationType number: Q2_K 10, Q3_K 11, Q6_K 14, IQ2_XXS 16, IQ2_XS 17,
//   IQ3_XXS 18, IQ1_S 19, IQ4_NL 20, IQ3_S 21, IQ2_S 22, IQ4_XS 23, IQ1_M 29), OT (output dtype)
// inputs:
//   blocks [rows, row_bytes] uint8   the GGUF bytes of the rows (row_bytes = cols / ELEMS * BYTES)
//   grid   [entries, 8 or 4] uint8/int8   lattice of IQ1_*/IQ2_*/IQ3_* (formats.tables), else a 1-element placeholder
//   signs  [128] uint8                 sign patterns of IQ2_XXS, IQ2_XS, IQ3_XXS, else a placeholder
//   values [16] int8                   non-linear levels of IQ4_NL, IQ4_XS, else a placeholder
// outputs:
//   out    [rows, cols] OT
// Exactness: gguf-py's float32 operations in gguf-py's order (fp16 scale -> float, then its products). Each
// product is exact in float32: an fp16 scale has 11 significant bits and the integer scales, grid levels and quants
// multiplied into it add at most 13 (IQ4_XS: 11 + 6 + 7 = 24), so the only rounding is Q2_K's final
// dl * q - ml (dl * q exact). Fused multiply-adds (any fp-contract setting; the emulator's g++ build does none) or
// a reordering of the products therefore cannot change a bit. Assumed, not checked on a Mac: fp16 subnormal
// scales convert exactly (a GPU flushing half denormals would give 0 for them).
// Address spaces: blocks always has >= 18 bytes (device) and is passed to helpers typed `const device`; the tables
// (placeholders are 1-element, hence `constant`) only reach helpers whose pointer types are template parameters.
// @inputs blocks grid signs values
// @outputs out
// @include ggml_blocks.h
// @body
using Blk = Block<TYPE>;
constexpr int CPB = Blk::ELEMS / 16;  // 16-weight chunks per block
const int c = thread_position_in_grid.x;
const ulong r = thread_position_in_grid.y;
const int row_bytes = blocks_shape[1];
const ulong cols = ulong(row_bytes / Blk::BYTES) * Blk::ELEMS;
float w[16];
Blk::decode16(blocks + r * row_bytes + (c / CPB) * Blk::BYTES, c % CPB, grid, signs, values, w);
for (int j = 0; j < 16; ++j) {
  out[r * cols + 16 * c + j] = static_cast<OT>(w[j]);
}
