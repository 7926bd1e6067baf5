/* Fused FP8_BLOCK quantization of bf16 weights, bit-identical to
 * compressed-tensors. See _fused_cpu.py for why it exists and how each
 * rounding step matches torch's. Built on first use by _fused_cpu.py. */
#include <stdint.h>
#include <string.h>

static inline float bits_to_f32(uint32_t bits) { float f; memcpy(&f, &bits, 4); return f; }
static inline uint32_t f32_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
/* fp32 -> bf16 round-to-nearest-even, as c10::BFloat16 does for finite values. */
static inline uint16_t f32_to_bf16_rne(float f) {
  uint32_t u = f32_to_bits(f);
  return (uint16_t)((u + ((u >> 16) & 1u) + 0x7FFFu) >> 16);
}
static inline float bf16_to_f32(uint16_t b) { return bits_to_f32((uint32_t)b << 16); }

enum { BF16_INF = 0x7F80, BF16_NAN = 0x7FC0, BF16_EPS = 0x3C00 /* 2^-7 */ };

/* w: [rows, cols] bf16 bits; codes: [rows, cols] fp8 bits; scales: [nbr, nbc]
 * bf16 bits; table: fp8 code of clamp(bf16, -448, 448) for every bf16 pattern.
 * A block holding NaN/Inf gets a NaN scale and no codes: the caller refuses it. */
void refit_fp8_block_bf16(const uint16_t *w, uint8_t *codes, uint16_t *scales,
                          const uint8_t *table, long rows, long cols, long bh,
                          long bw, int threads) {
  const long nbr = (rows + bh - 1) / bh, nbc = (cols + bw - 1) / bw;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (long bi = 0; bi < nbr; bi++) {
    const long r0 = bi * bh, r1 = r0 + bh < rows ? r0 + bh : rows;
    uint16_t quotient[bw];
    for (long bj = 0; bj < nbc; bj++) {
      const long c0 = bj * bw, width = (c0 + bw < cols ? c0 + bw : cols) - c0;
      /* |x| by bits: for non-negative floats, integer order is float order. */
      uint16_t amax = 0;
      for (long r = r0; r < r1; r++) {
        const uint16_t *row = w + r * cols + c0;
        for (long c = 0; c < width; c++) {
          const uint16_t a = row[c] & 0x7FFF;
          amax = a > amax ? a : amax;
        }
      }
      if (amax >= BF16_INF) { scales[bi * nbc + bj] = BF16_NAN; continue; }
      uint16_t scale = f32_to_bf16_rne(bf16_to_f32(amax) / 448.0f);
      if (scale == 0) scale = BF16_EPS;
      scales[bi * nbc + bj] = scale;
      const float s = bf16_to_f32(scale);
      for (long r = r0; r < r1; r++) {
        const uint16_t *row = w + r * cols + c0;
        uint8_t *out = codes + r * cols + c0;
        for (long c = 0; c < width; c++) quotient[c] = f32_to_bf16_rne(bf16_to_f32(row[c]) / s);
        for (long c = 0; c < width; c++) out[c] = table[quotient[c]];
      }
    }
  }
}
