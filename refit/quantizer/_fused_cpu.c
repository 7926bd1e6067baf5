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
  /* Below 2^-6, e4m3 is subnormal with step 2^-9. Adding 2^14 makes the FPU
   * round at exactly that step (ties to even); the low bits of the sum are
   * then the code. */
  const uint32_t subnormal = f32_to_bits(bits_to_f32(mag) + bits_to_f32(141u << 23)) - (141u << 23);
  /* Normal: rebias the exponent 127 -> 7, round 23 -> 3 mantissa bits to
   * nearest even (wraps for subnormals, which do not take it). */
  const uint32_t normal = (mag - (120u << 23) + 0x7FFFFu + ((mag >> 20) & 1u)) >> 20;
  /* Both computed, one selected by a bit mask: with `?:` selects, GCC left
   * the loop unvectorized on AVX2 ("control flow in loop"; AVX-512 masks
   * it): 0.4 GB/s a core on an AMD EPYC. */
  const uint32_t is_subnormal = 0u - (uint32_t)(mag < (121u << 23));
  const uint32_t code = (subnormal & is_subnormal) | (normal & ~is_subnormal);
  return (uint8_t)((code | sign) & (0u - (uint32_t)(mag != 0)));
}

/* A block's scale from its amax, as compressed-tensors computes it (before a
 * zero scale becomes eps): amax / 448, rounded to bf16. */
static inline uint16_t scale_of(uint16_t amax) { return f32_to_bf16_rne(bf16_to_f32(amax) / 448.0f); }

/* A value's code in a block of scale s: torch's division, rounded to bf16,
 * then to FP8; and the same through the block's reciprocal scale. */
static inline uint8_t quotient_code(float x, float s) { return bf16_to_fp8_e4m3(f32_to_bf16_rne(x / s)); }
static inline uint8_t product_code(float x, float inverse) { return bf16_to_fp8_e4m3(f32_to_bf16_rne(x * inverse)); }

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
      uint16_t scale = scale_of(amax);
      if (scale == 0) scale = BF16_EPS;
      scales[bi * nbc + bj] = scale;
      const float s = bf16_to_f32(scale), inverse = 1.0f / s;
      /* x / s as x * (1 / s): a product runs at several times a division's
       * throughput, and for every scale whose reciprocal is finite it gives
       * every value a block can hold the same code as the division
       * (refit_reciprocal_mismatches, run by the tests, checks all of them).
       * The 32 smallest subnormal scales, whose reciprocal overflows, divide. */
      const int divide = !__builtin_isfinite(inverse);
      for (long r = r0; r < r1; r++) {
        const uint16_t *row = w + r * cols + c0;
        uint8_t *out = codes + r * cols + c0;
        if (divide)
          for (long c = 0; c < width; c++) out[c] = quotient_code(bf16_to_f32(row[c]), s);
        else
          for (long c = 0; c < width; c++) out[c] = product_code(bf16_to_f32(row[c]), inverse);
      }
    }
  }
}

/* How many (scale, value) pairs the kernel's product x * (1 / s) codes
 * differently from the division x / s: every positive finite bf16 scale with
 * a finite reciprocal, against every positive finite bf16 value that a block
 * with that scale can hold (a value whose own scale would be at most s: the
 * scale grows with a block's amax). Negative values mirror positive ones
 * (both roundings are symmetric). 0 is the kernel's licence to multiply. */
long refit_reciprocal_mismatches(void) {
  long mismatches = 0;
#pragma omp parallel for reduction(+ : mismatches) schedule(dynamic, 64)
  for (long scale = 1; scale < BF16_INF; scale++) {
    const float s = bf16_to_f32((uint16_t)scale), inverse = 1.0f / s;
    if (!__builtin_isfinite(inverse)) continue;
    /* The largest value whose own scale is at most s (bisection: values, and
     * their scales, grow with their bits). */
    uint32_t lo = 0, hi = BF16_INF;
    while (hi - lo > 1) {
      const uint32_t mid = (lo + hi) / 2;
      if (scale_of((uint16_t)mid) <= scale) lo = mid; else hi = mid;
    }
    long differ = 0;
    for (uint32_t bits = 0; bits <= lo; bits++) {
      const float x = bf16_to_f32((uint16_t)bits);
      differ += product_code(x, inverse) != quotient_code(x, s);
    }
    mismatches += differ;
  }
  return mismatches;
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

/* Delta syncs (refit/transport/delta.py): compare two byte arrays of `width`-byte elements (1, 2, 4 or 8)
   and write a delta's parts in the same pass: per chunk of 65536 elements the count of changed ones, each
   changed element's bytes (from a), the low 16 bits of its index. Returns how many changed, or -1 as soon
   as more than `cap` did (the entry then travels whole). 64 bytes are compared at a time with word XORs,
   which the compiler vectorizes; in a word that differs, each changed element is found from the XOR's
   lowest set bit, so the cost is per change, not per byte. */
long refit_diff_encode(const uint8_t *a, const uint8_t *b, long nbytes, int width, long cap,
                       int32_t *counts, uint8_t *values, uint16_t *low) {
    long count = 0, i = 0;
    for (; i + 64 <= nbytes; i += 64) {
        uint64_t x[8], any = 0;
        for (int k = 0; k < 8; k++) {
            uint64_t u, v;
            memcpy(&u, a + i + 8 * k, 8);
            memcpy(&v, b + i + 8 * k, 8);
            x[k] = u ^ v;
            any |= x[k];
        }
        for (int k = 0; any && k < 8; k++) {
            const uint64_t lane = width == 8 ? ~0ULL : (1ULL << (8 * width)) - 1;
            uint64_t w = x[k];
            while (w) {
                const int element = __builtin_ctzll(w) / (8 * width);
                const long index = (i / 8 + k) * (8 / width) + element;
                if (count == cap) return -1;
                counts[index >> 16]++;
                memcpy(values + count * width, a + index * width, (size_t)width);
                low[count++] = (uint16_t)(index & 0xFFFF);
                w &= ~(lane << (8 * width * element));
            }
        }
    }
    for (; i < nbytes; i += width) {
        if (memcmp(a + i, b + i, (size_t)width)) {
            const long index = i / width;
            if (count == cap) return -1;
            counts[index >> 16]++;
            memcpy(values + count * width, a + i, (size_t)width);
            low[count++] = (uint16_t)(index & 0xFFFF);
        }
    }
    return count;
}

/* Write a delta's elements into `stored` (numel elements of `width` bytes); -1 if its counts or indices do
   not fit (the caller refuses the delta), else 0. */
int refit_delta_apply(uint8_t *stored, long numel, int width, const int32_t *counts, long chunks,
                      const uint8_t *values, const uint16_t *low, long n) {
    long k = 0;
    for (long chunk = 0; chunk < chunks; chunk++) {
        if (counts[chunk] < 0 || k + counts[chunk] > n) return -1;
        for (long end = k + counts[chunk]; k < end; k++) {
            const long index = (chunk << 16) | low[k];
            if (index >= numel) return -1;
            memcpy(stored + index * width, values + k * width, (size_t)width);
        }
    }
    return k == n ? 0 : -1;
}

/* Steps of elements `width` bytes wide (2, 4 or 8), as integers: each element of `a` minus the same element
   of `b`, modulo 2^(8*width). Sets one bit per changed element in `bitmap` (zeroed by the caller, little-
   endian bit order) and writes each changed element's step as int8, in element order: small updates move a
   bf16 value by a few units of its last place. A step outside -127..127 is written as -128 (an escape) and
   the new element's bytes are appended to `escaped`. Returns how many changed (*n_escaped: how many escaped);
   `steps` and `escaped` have room for every element. */
static inline uint64_t element_at(const uint8_t *p, long index, int width) {
    uint64_t v = 0;
    memcpy(&v, p + index * width, (size_t)width);  /* little-endian: the low bytes of v */
    return v;
}

static inline void encode_step(const uint8_t *a, const uint8_t *b, long i, int width, uint64_t mask,
                               long *count, long *n_escaped, uint8_t *bitmap, int8_t *steps, uint8_t *escaped) {
    const uint64_t step = (element_at(a, i, width) - element_at(b, i, width)) & mask;
    if (!step) return;
    bitmap[i >> 3] |= (uint8_t)(1u << (i & 7));
    if (step <= 127 || step >= mask - 126) {  /* 1..127 or -127..-1 */
        steps[(*count)++] = (int8_t)(step & 0xFF);
    } else {
        steps[(*count)++] = -128;
        memcpy(escaped + (*n_escaped)++ * width, a + i * width, (size_t)width);
    }
}

/* Two-byte elements (bf16, the case that matters), without branches on the data: 5-25% of elements change,
   scattered, so a branch per element mispredicts often. Every step and escape is written, and the counts
   advance only where the element changed (the buffers hold `numel` of each). */
static long steps_encode_16(const uint16_t *a, const uint16_t *b, long numel, uint8_t *bitmap, int8_t *steps,
                            uint16_t *escaped, long *n_escaped) {
    long count = 0, ne = 0;
    for (long base = 0; base < numel; base += 8) {
        const long end = base + 8 < numel ? base + 8 : numel;
        uint64_t u = 0, v = 0;
        if (end - base == 8) {
            memcpy(&u, a + base, 8);
            memcpy(&v, b + base, 8);
            if (u == v) {
                uint64_t u2, v2;
                memcpy(&u2, a + base + 4, 8);
                memcpy(&v2, b + base + 4, 8);
                if (u2 == v2) continue;
            }
        }
        unsigned bits = 0;
        for (long i = base; i < end; i++) {
            const int16_t step = (int16_t)(uint16_t)(a[i] - b[i]);
            const int changed = step != 0, fits = step >= -127 && step <= 127;
            bits |= (unsigned)changed << (i - base);
            steps[count] = fits ? (int8_t)step : (int8_t)-128;
            escaped[ne] = a[i];
            count += changed;
            ne += changed & !fits;
        }
        bitmap[base >> 3] = (uint8_t)bits;
    }
    *n_escaped = ne;
    return count;
}

long refit_steps_encode(const uint8_t *a, const uint8_t *b, long numel, int width,
                        uint8_t *bitmap, int8_t *steps, uint8_t *escaped, long *n_escaped) {
    if (width == 2)
        return steps_encode_16((const uint16_t *)a, (const uint16_t *)b, numel, bitmap, steps, (uint16_t *)escaped, n_escaped);
    const uint64_t mask = width == 8 ? ~0ULL : (1ULL << (8 * width)) - 1;
    const long per_word = 8 / width;
    long count = 0, i = 0;
    *n_escaped = 0;
    for (; i + per_word <= numel; i += per_word) {  /* whole equal words skipped at memory speed */
        uint64_t u, v;
        memcpy(&u, a + i * width, 8);
        memcpy(&v, b + i * width, 8);
        if (u == v) continue;
        for (long j = i; j < i + per_word; j++)
            encode_step(a, b, j, width, mask, &count, n_escaped, bitmap, steps, escaped);
    }
    for (; i < numel; i++)
        encode_step(a, b, i, width, mask, &count, n_escaped, bitmap, steps, escaped);
    return count;
}

/* Apply a steps delta to `stored` in place; -1 (nothing written) if the bitmap marks another number of
   elements than `n` or elements past `numel`, or the steps escape another number than `n_escaped`. */
int refit_steps_apply(uint8_t *stored, long numel, int width, const uint8_t *bitmap, const int8_t *steps, long n,
                      const uint8_t *escaped, long n_escaped) {
    const uint64_t mask = width == 8 ? ~0ULL : (1ULL << (8 * width)) - 1;
    long marked = 0, escapes = 0;
    for (long byte = 0; byte < (numel + 7) / 8; byte++) marked += __builtin_popcount(bitmap[byte]);
    for (long k = 0; k < n; k++) escapes += steps[k] == -128;
    if (marked != n || escapes != n_escaped || (numel % 8 && bitmap[numel / 8] >> (numel % 8))) return -1;
    long k = 0, e = 0;
    for (long byte = 0; byte < (numel + 7) / 8; byte++) {
        for (unsigned bits = bitmap[byte]; bits; bits &= bits - 1) {
            const long i = byte * 8 + __builtin_ctz(bits);
            const int8_t step = steps[k++];
            if (step == -128) {
                memcpy(stored + i * width, escaped + e++ * width, (size_t)width);
            } else {
                const uint64_t value = (element_at(stored, i, width) + (uint64_t)(int64_t)step) & mask;
                memcpy(stored + i * width, &value, (size_t)width);
            }
        }
    }
    return 0;
}

/* A bitmap delta: one bit per element of `width` bytes whose bytes differ (little-endian bit order, `bitmap`
   zeroed by the caller), then the changed elements' new bytes, in element order. Equal 8-byte words are
   skipped at memory speed. Returns how many changed. */
/* One-byte elements (FP8 codes) without branches on the data, as `steps_encode_16`: every element's byte is
   written, and the count advances only where it changed (`values` holds `numel`). */
static long bitmap_encode_8(const uint8_t *a, const uint8_t *b, long numel, uint8_t *bitmap, uint8_t *values) {
    long count = 0;
    for (long base = 0; base < numel; base += 8) {
        const long end = base + 8 < numel ? base + 8 : numel;
        if (end - base == 8) {
            uint64_t u, v;
            memcpy(&u, a + base, 8);
            memcpy(&v, b + base, 8);
            if (u == v) continue;
        }
        unsigned bits = 0;
        for (long i = base; i < end; i++) {
            const unsigned changed = a[i] != b[i];
            bits |= changed << (i - base);
            values[count] = a[i];
            count += changed;
        }
        bitmap[base >> 3] = (uint8_t)bits;
    }
    return count;
}

long refit_bitmap_encode(const uint8_t *a, const uint8_t *b, long numel, int width, uint8_t *bitmap, uint8_t *values) {
    if (width == 1) return bitmap_encode_8(a, b, numel, bitmap, values);
    const long per_word = 8 / width;
    long count = 0, i = 0;
    for (; i + per_word <= numel; i += per_word) {
        uint64_t u, v;
        memcpy(&u, a + i * width, 8);
        memcpy(&v, b + i * width, 8);
        if (u == v) continue;
        for (long j = i; j < i + per_word; j++) {
            if (memcmp(a + j * width, b + j * width, (size_t)width)) {
                bitmap[j >> 3] |= (uint8_t)(1u << (j & 7));
                memcpy(values + count++ * width, a + j * width, (size_t)width);
            }
        }
    }
    for (; i < numel; i++) {
        if (memcmp(a + i * width, b + i * width, (size_t)width)) {
            bitmap[i >> 3] |= (uint8_t)(1u << (i & 7));
            memcpy(values + count++ * width, a + i * width, (size_t)width);
        }
    }
    return count;
}

/* Write a bitmap delta's values into `stored` in place; -1 (nothing written) if the bitmap marks another
   number of elements than `n`, or elements past `numel`. */
int refit_bitmap_apply(uint8_t *stored, long numel, int width, const uint8_t *bitmap, const uint8_t *values, long n) {
    long marked = 0;
    for (long byte = 0; byte < (numel + 7) / 8; byte++) marked += __builtin_popcount(bitmap[byte]);
    if (marked != n || (numel % 8 && bitmap[numel / 8] >> (numel % 8))) return -1;
    long k = 0;
    for (long byte = 0; byte < (numel + 7) / 8; byte++)
        for (unsigned bits = bitmap[byte]; bits; bits &= bits - 1)
            memcpy(stored + (byte * 8 + __builtin_ctz(bits)) * width, values + k++ * width, (size_t)width);
    return 0;
}
