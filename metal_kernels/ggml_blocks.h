// ggml_blocks.h: the GGML block decoders shared by ggml_dequant.metal and ggml_matvec.metal (pulled in by their
// `// @include ggml_blocks.h` line): Block<TYPE>::decode16 writes 16 consecutive weights of a block, exactly as
// gguf-py dequantizes them (see ggml_dequant.metal's header for why no rounding differs).

// Little-endian fields of a block (blocks are only byte-aligned).
inline uint u16_at(const device uint8_t* b, int o) {
  return uint(b[o]) | (uint(b[o + 1]) << 8);
}
inline uint u32_at(const device uint8_t* b, int o) {
  return u16_at(b, o) | (u16_at(b, o + 2) << 16);
}
// The fp16 scale fields, as gguf-py reads them (view float16, astype float32).
inline float fp16_value(uint bits) {
  return float(as_type<half>(ushort(bits)));
}
inline float fp16_at(const device uint8_t* b, int o) {
  return fp16_value(u16_at(b, o));
}
// 4-bit field k of the nibble array at byte o (low nibble first).
inline uint nibble(const device uint8_t* b, int o, int k) {
  return (b[o + k / 2] >> (4 * (k % 2))) & 0xF;
}
// 6-bit scale of Q3_K and IQ4_XS: 4 low bits and 2 high bits, minus 32.
inline float scale6(uint lo4, uint hi2) {
  return float(int(lo4 | (hi2 << 4)) - 32);
}
// IQ2_* / IQ3_XXS block scale d * (0.5 + s) * f, in gguf-py's order.
inline float iq_scale(float d, uint s, float f) {
  const float a = d * (0.5f + float(s));
  return a * f;
}
// W weights of lattice row idx times db, negated where bit j of sign_bits is set ((db * grid) * sign in gguf-py).
template <int W, typename G>
inline void signed_grid(float db, G grid, uint idx, uint sign_bits, thread float* w) {
  for (int j = 0; j < W; ++j) {
    const float v = db * float(grid[idx * W + j]);
    w[j] = ((sign_bits >> j) & 1) ? -v : v;
  }
}
// IQ1_S / IQ1_M: 8 weights dl * (grid + delta).
template <typename G>
inline void iq1_group(float dl, float delta, G grid, uint idx, thread float* w) {
  for (int j = 0; j < 8; ++j) {
    const float g = float(grid[idx * 8 + j]) + delta;
    w[j] = dl * g;
  }
}

// Block<TYPE>: ELEMS weights in BYTES bytes; decode16(b, c, ...) writes weights 16 c .. 16 c + 15 of block b.
template <int TYPE>
struct Block;

template <>
struct Block<10> {  // Q2_K: scales[16] @0 (scale | min << 4), qs[64] @16, d @80, dmin @82
  static constant constexpr const int ELEMS = 256;
  static constant constexpr const int BYTES = 84;
  template <typename G, typename S, typename V>
  static void decode16(const device uint8_t* b, int c, G, S, V, thread float* w) {
    const uint sc = b[c];
    const float dl = fp16_at(b, 80) * float(sc & 0xF);
    const float ml = fp16_at(b, 82) * float(sc >> 4);
    const int q0 = 16 + 32 * (c / 8) + 16 * (c % 2);
    const int shift = 2 * ((c % 8) / 2);
    for (int j = 0; j < 16; ++j) {
      w[j] = dl * float((b[q0 + j] >> shift) & 3) - ml;
    }
  }
};

template <>
struct Block<11> {  // Q3_K: hmask[32] @0, qs[64] @32, scales[12] @96 (16 x 6 bits), d @108
  static constant constexpr const int ELEMS = 256;
  static constant constexpr const int BYTES = 110;
  template <typename G, typename S, typename V>
  static void decode16(const device uint8_t* b, int c, G, S, V, thread float* w) {
    const uint lo4 = (b[96 + c % 8] >> (4 * (c / 8))) & 0xF;
    const uint hi2 = (b[104 + c % 4] >> (2 * (c / 4))) & 3;
    const float dl = fp16_at(b, 108) * scale6(lo4, hi2);
    const int l0 = 16 * (c % 2);  // weight 16 c + j sits at lane l0 + j of its 32-weight group
    const int q0 = 32 + 32 * (c / 8) + l0;
    const int shift = 2 * ((c % 8) / 2);
    const int hbit = c / 2;
    for (int j = 0; j < 16; ++j) {
      const int low = (b[q0 + j] >> shift) & 3;
      const int q = ((b[l0 + j] >> hbit) & 1) ? low : low - 4;
      w[j] = dl * float(q);
    }
  }
};

template <>
struct Block<14> {  // Q6_K: ql[128] @0, qh[64] @128, scales int8[16] @192, d @208
  static constant constexpr const int ELEMS = 256;
  static constant constexpr const int BYTES = 210;
  template <typename G, typename S, typename V>
  static void decode16(const device uint8_t* b, int c, G, S, V, thread float* w) {
    const float dl = fp16_at(b, 208) * float(as_type<char>(b[192 + c]));
    const int l0 = 64 * (c / 8) + 16 * (c % 4);
    const int h0 = 128 + 32 * (c / 8) + 16 * (c % 2);
    const int lshift = 4 * ((c % 8) / 4);
    const int hshift = 2 * ((c % 8) / 2);
    for (int j = 0; j < 16; ++j) {
      const int q = int(((b[l0 + j] >> lshift) & 0xF) | (((b[h0 + j] >> hshift) & 3) << 4)) - 32;
      w[j] = dl * float(q);
    }
  }
};

template <>
struct Block<16> {  // IQ2_XXS: d @0, 8 x (grid idx u8[4], u32 @+4: 4 x 7-bit sign idx | 4-bit scale << 28) @2
  static constant constexpr const int ELEMS = 256;
  static constant constexpr const int BYTES = 66;
  template <typename G, typename S, typename V>
  static void decode16(const device uint8_t* b, int c, G grid, S signs, V, thread float* w) {
    const int o = 2 + 8 * (c / 2);
    const uint aux = u32_at(b, o + 4);
    const float db = iq_scale(fp16_at(b, 0), aux >> 28, 0.25f);
    for (int h = 0; h < 2; ++h) {
      const int g = 2 * (c % 2) + h;
      signed_grid<8>(db, grid, b[o + g], signs[(aux >> (7 * g)) & 127], w + 8 * h);
    }
  }
};

template <>
struct Block<17> {  // IQ2_XS: d @0, qs u16[32] @2 (9-bit grid idx | 7-bit sign idx << 9), scales[8] @66
  static constant constexpr const int ELEMS = 256;
  static constant constexpr const int BYTES = 74;
  template <typename G, typename S, typename V>
  static void decode16(const device uint8_t* b, int c, G grid, S signs, V, thread float* w) {
    const float db = iq_scale(fp16_at(b, 0), nibble(b, 66, c), 0.25f);
    for (int h = 0; h < 2; ++h) {
      const uint q = u16_at(b, 2 + 2 * (2 * c + h));
      signed_grid<8>(db, grid, q & 511, signs[q >> 9], w + 8 * h);
    }
  }
};

template <>
struct Block<22> {  // IQ2_S: d @0, qs[32] @2, signs[32] @34, qh[8] @66 (2 high idx bits each), scales[8] @74
  static constant constexpr const int ELEMS = 256;
  static constant constexpr const int BYTES = 82;
  template <typename G, typename S, typename V>
  static void decode16(const device uint8_t* b, int c, G grid, S, V, thread float* w) {
    const float db = iq_scale(fp16_at(b, 0), nibble(b, 74, c), 0.25f);
    for (int h = 0; h < 2; ++h) {
      const int i = 2 * c + h;
      const uint idx = b[2 + i] | (((b[66 + i / 4] >> (2 * (i % 4))) & 3) << 8);
      signed_grid<8>(db, grid, idx, b[34 + i], w + 8 * h);
    }
  }
};

template <>
struct Block<18> {  // IQ3_XXS: d @0, qs[64] @2 (grid idx), u32[8] @66 (4 x 7-bit sign idx | 4-bit scale << 28)
  static constant constexpr const int ELEMS = 256;
  static constant constexpr const int BYTES = 98;
  template <typename G, typename S, typename V>
  static void decode16(const device uint8_t* b, int c, G grid, S signs, V, thread float* w) {
    const uint aux = u32_at(b, 66 + 4 * (c / 2));
    const float db = iq_scale(fp16_at(b, 0), aux >> 28, 0.5f);
    for (int h = 0; h < 2; ++h) {
      const int g = 2 * (c % 2) + h;
      const int q = 2 + 8 * (c / 2) + 2 * g;
      const uint s = signs[(aux >> (7 * g)) & 127];
      signed_grid<4>(db, grid, b[q], s, w + 8 * h);
      signed_grid<4>(db, grid, b[q + 1], s >> 4, w + 8 * h + 4);
    }
  }
};

template <>
struct Block<21> {  // IQ3_S: d @0, qs[64] @2, qh[8] @66 (9th idx bit), signs[32] @74, scales[4] @106
  static constant constexpr const int ELEMS = 256;
  static constant constexpr const int BYTES = 110;
  template <typename G, typename S, typename V>
  static void decode16(const device uint8_t* b, int c, G grid, S, V, thread float* w) {
    const float db = fp16_at(b, 0) * float(1 + 2 * nibble(b, 106, c / 2));
    for (int k = 0; k < 4; ++k) {
      const int i = 4 * c + k;
      const uint idx = b[2 + i] | (((b[66 + i / 8] >> (i % 8)) & 1) << 8);
      signed_grid<4>(db, grid, idx, b[74 + 2 * c + k / 2] >> (4 * (k % 2)), w + 4 * k);
    }
  }
};

template <>
struct Block<19> {  // IQ1_S: d @0, qs[32] @2, qh u16[8] @34 (4 x 3 high idx bits, 3-bit scale << 12, delta sign)
  static constant constexpr const int ELEMS = 256;
  static constant constexpr const int BYTES = 50;
  template <typename G, typename S, typename V>
  static void decode16(const device uint8_t* b, int c, G grid, S, V, thread float* w) {
    const uint qh = u16_at(b, 34 + 2 * (c / 2));
    const float dl = fp16_at(b, 0) * float(2 * ((qh >> 12) & 7) + 1);
    const float delta = (qh & 0x8000) ? -0.125f : 0.125f;
    for (int h = 0; h < 2; ++h) {
      const int g = 2 * (c % 2) + h;
      iq1_group(dl, delta, grid, b[2 + 4 * (c / 2) + g] | (((qh >> (3 * g)) & 7) << 8), w + 8 * h);
    }
  }
};

template <>
struct Block<29> {  // IQ1_M: qs[32] @0, qh[16] @32 (2 x (3 high idx bits, delta sign)), scales u16[4] @48
  static constant constexpr const int ELEMS = 256;
  static constant constexpr const int BYTES = 56;
  template <typename G, typename S, typename V>
  static void decode16(const device uint8_t* b, int c, G grid, S, V, thread float* w) {
    // the fp16 d is the top nibbles of the four scale words, lowest word first
    const uint d_bits = (u16_at(b, 48) >> 12) | ((u16_at(b, 50) >> 8) & 0xF0) | ((u16_at(b, 52) >> 4) & 0xF00) |
                        (u16_at(b, 54) & 0xF000);
    const uint sc = (u16_at(b, 48 + 2 * (c / 4)) >> (3 * (c % 4))) & 7;
    const float dl = fp16_value(d_bits) * float(2 * sc + 1);
    for (int h = 0; h < 2; ++h) {
      const uint nib = (b[32 + c] >> (4 * h)) & 0xF;
      const float delta = (nib & 8) ? -0.125f : 0.125f;
      iq1_group(dl, delta, grid, b[2 * c + h] | ((nib & 7) << 8), w + 8 * h);
    }
  }
};

template <>
struct Block<20> {  // IQ4_NL: d @0, qs[16] @2 (weights 0-15 low nibbles, 16-31 high nibbles)
  static constant constexpr const int ELEMS = 32;
  static constant constexpr const int BYTES = 18;
  template <typename G, typename S, typename V>
  static void decode16(const device uint8_t* b, int c, G, S, V values, thread float* w) {
    const float d = fp16_at(b, 0);
    for (int j = 0; j < 16; ++j) {
      w[j] = d * float(values[(b[2 + j] >> (4 * c)) & 0xF]);
    }
  }
};

template <>
struct Block<23> {  // IQ4_XS: d @0, scales_h u16 @2, scales_l[4] @4, qs[128] @8 (8 x 32 weights as IQ4_NL)
  static constant constexpr const int ELEMS = 256;
  static constant constexpr const int BYTES = 136;
  template <typename G, typename S, typename V>
  static void decode16(const device uint8_t* b, int c, G, S, V values, thread float* w) {
    const int ib = c / 2;
    const float dl = fp16_at(b, 0) * scale6(nibble(b, 4, ib), (u16_at(b, 2) >> (2 * ib)) & 3);
    for (int j = 0; j < 16; ++j) {
      w[j] = dl * float(values[(b[8 + 16 * ib + j] >> (4 * (c % 2))) & 0xF]);
    }
  }
};
