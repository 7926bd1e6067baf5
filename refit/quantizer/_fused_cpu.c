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

/* What torch computes for `(q + 0).clamp(-448, 448).to(float8_e4m3fn)` of a
 * finite bf16 q (c10's fp8e4m3fn_from_fp32_value, after the clamp), in
 * branch-free 32-bit lane arithmetic the compiler vectorizes; a table lookup
 * per element ran at half the speed. `+ 0` is compressed-tensors' zero point:
 * -0.0 becomes +0.0, while a tiny negative value still rounds to -0. Checked
 * against torch for all 65536 bit patterns by the tests. */
static inline uint8_t bf16_to_fp8_e4m3(uint16_t bits) {
  const uint32_t sign = (bits >> 8) & 0x80u;
  uint32_t mag = (uint32_t)(bits & 0x7FFFu) << 16; /* |q| as fp32 bits */
  mag = mag < 0x43E00000u ? mag : 0x43E00000u;     /* clamp to 448 */
  uint32_t code;
  if (mag < (121u << 23)) {
    /* Below 2^-6, e4m3 is subnormal with step 2^-9. Adding 2^14 makes the
     * FPU round at exactly that step (ties to even); the low bits of the sum
     * are then the code. */
    code = f32_to_bits(bits_to_f32(mag) + bits_to_f32(141u << 23)) - (141u << 23);
  } else {
    /* Normal: rebias the exponent 127 -> 7, round 23 -> 3 mantissa bits to nearest even. */
    code = (mag - (120u << 23) + 0x7FFFFu + ((mag >> 20) & 1u)) >> 20;
  }
  return (uint8_t)(mag ? (code | sign) : 0u);
}

/* The conversion alone, exported for the exhaustive test. */
void refit_bf16_to_fp8_e4m3(const uint16_t *in, uint8_t *out, long n) {
  for (long i = 0; i < n; i++) out[i] = bf16_to_fp8_e4m3(in[i]);
}

/* w: [rows, cols] bf16 bits; codes: [rows, cols] fp8 bits; scales: [nbr, nbc]
 * bf16 bits. A block holding NaN/Inf gets a NaN scale and no codes: the
 * caller refuses it. */
void refit_fp8_block_bf16(const uint16_t *w, uint8_t *codes, uint16_t *scales,
                          long rows, long cols, long bh, long bw, int threads) {
  const long nbr = (rows + bh - 1) / bh, nbc = (cols + bw - 1) / bw;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (long bi = 0; bi < nbr; bi++) {
    const long r0 = bi * bh, r1 = r0 + bh < rows ? r0 + bh : rows;
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
        for (long c = 0; c < width; c++) out[c] = bf16_to_fp8_e4m3(f32_to_bf16_rne(bf16_to_f32(row[c]) / s));
      }
    }
  }
}

/* Whether every bf16 value is finite (its exponent is not all ones). Read-only
 * and vectorized: a refit checks every trainer tensor before sending any, and
 * torch.isfinite(t).all() writes a bool tensor as large as t to answer this. */
int refit_bf16_all_finite(const uint16_t *x, long n, int threads) {
  int bad = 0;
#pragma omp parallel for reduction(| : bad) schedule(static) num_threads(threads)
  for (long i = 0; i < n; i++) bad |= (x[i] & 0x7F80) == 0x7F80;
  return !bad;
}
