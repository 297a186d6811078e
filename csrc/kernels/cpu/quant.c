/* Block-quantized weight rows on the CPU (quant_impl.h): llama.cpp's GGUF block formats
 * Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K and int8 rows (a float32 scale, then K int8).
 *
 * Layouts (little-endian, packed; "f16" an IEEE half):
 *   Q8_0  34 B / 32:  f16 d; int8 q[32]                      x = q d
 *   Q4_0  18 B / 32:  f16 d; u8 qs[16]                       x[j] = d (lo(qs[j]) - 8), x[j+16] = d (hi(qs[j]) - 8)
 *   Q4_1  20 B / 32:  f16 d, m; u8 qs[16]                    x = (d q) + m, q as Q4_0's without the 8
 *   Q4_K 144 B / 256: f16 d, dmin; u8 scales[12]; u8 qs[128] sub-block s of 32: x = (d sc_s) q - (dmin mn_s),
 *                     sc/mn 6-bit (get_scale_min below); sub-blocks 2i, 2i+1: lo, hi nibbles of qs[32i..32i+31]
 *   Q5_K 176 B / 256: as Q4_K with u8 qh[32] before qs: bit s of qh[l] is bit 4 of element l of sub-block s
 *   Q6_K 210 B / 256: u8 ql[128]; u8 qh[64]; int8 scales[16]; f16 d; element 128h + 32i + l (i < 4, l < 32):
 *                     q = (nibble i/2 of ql[64h + 32(i%2) + l]) | ((qh[32h + l] >> 2i) & 3) << 4, minus 32;
 *                     x = (d scales[n/16]) q
 * The dequantizers do gguf-py's float32 operations in its order (its products are never
 * fused with the following sum: NOFUSE), so they equal its dequantize_blocks bit for bit.
 *
 * The dot kernels (x float32, the row dequantized in registers) come for AVX-512F, for
 * AVX2+FMA+F16C and portable C; tp_q_dot1_for / tp_q_dot4_for pick the widest this CPU
 * runs, once.  AVX-512 looks the 4-bit codes up in a 16-entry table of the block's values
 * (d i + m, Q4_K: D i - DM; vpermps reads the low 4 bits of each index, so the nibbles
 * need no mask and no int-to-float conversion, and the min costs nothing per element: one
 * FMA per table); AVX2 converts the codes and applies d and m with one FMA.  Separate sums
 * of x per block for the min term would cost more here: x is not shared between calls.
 * Measured (csrc/tests/bench_quant.c, one Zen 4 thread, K = 576 .. 1536): Q4_1 ~9 GB/s of
 * weights, Q8_0 ~18, Q4_K ~9, Q6_K ~6.5, the same from cache as from memory: bound by the
 * FP pipes (about five cycles a 32-element block), not by the ~21 GB/s one thread reads. */
#include <math.h>
#include <string.h>

#include "../../core/core_impl.h"
#include "quant_impl.h"

#if defined(__GNUC__) && defined(__x86_64__) && !defined(TP_NO_CLONES)
#define TP_Q_X86 1
#include <immintrin.h>
#endif

/* A product the compiler must round before it is added to anything (gguf-py rounds both
 * operations): where the target has FMA instructions (-march=native builds, other CPUs) an
 * empty asm that "changes" the value keeps GCC from contracting a * b + c under any
 * -ffp-contract.  The baseline x86-64 has no FMA to contract into, and there the scalar
 * loops stay free to vectorize. */
#if defined(__GNUC__) && defined(__x86_64__) && (defined(__FMA__) || defined(__FMA4__))
#define NOFUSE(v) __asm__("" : "+x"(v))
#elif defined(__GNUC__) && defined(__aarch64__)
#define NOFUSE(v) __asm__("" : "+w"(v))
#elif defined(__GNUC__) && !defined(__x86_64__)
#define NOFUSE(v) __asm__("" : "+m"(v))
#else
#define NOFUSE(v) ((void)0)
#endif

#define QK 32   /* elements of a Q8_0 / Q4_0 / Q4_1 block */
#define QKK 256 /* elements of a K-quant super-block */

static inline float h2f(const uint8_t *p) { return tp_half_to_float((uint16_t)(p[0] | p[1] << 8)); }

static inline void f2h(uint8_t *p, float f) {
  uint16_t h = tp_float_to_half(f);
  p[0] = (uint8_t)h, p[1] = (uint8_t)(h >> 8);
}

/* The float32 value of the f16 that f rounds to (what a reader of the stored field gets). */
static inline float round_half(float f) { return tp_half_to_float(tp_float_to_half(f)); }

int tp_q_format(tp_dtype_t f) {
  switch (f) {
    case TP_INT8:
    case TP_Q8_0:
    case TP_Q4_0:
    case TP_Q4_1:
    case TP_Q4_K:
    case TP_Q5_K:
    case TP_Q6_K: return 1;
    default: return 0;
  }
}

/* ------------------------------------------------------------------ scalar dequantization */

/* Sub-block j's 6-bit scale and min of a Q4_K / Q5_K super-block (scales[12]). */
static inline void get_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
  if (j < 4) {
    *sc = s[j] & 63, *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

static void deq_q8_0(float *y, const uint8_t *b) {
  float d = h2f(b);
  for (int j = 0; j < QK; j++) y[j] = (float)(int8_t)b[2 + j] * d;
}

static void deq_q4_0(float *y, const uint8_t *b) {
  float d = h2f(b);
  for (int j = 0; j < QK / 2; j++) {
    y[j] = d * (float)((b[2 + j] & 15) - 8);
    y[j + QK / 2] = d * (float)((b[2 + j] >> 4) - 8);
  }
}

static void deq_q4_1(float *y, const uint8_t *b) {
  float d = h2f(b), m = h2f(b + 2);
  for (int j = 0; j < QK / 2; j++) {
    float lo = d * (float)(b[4 + j] & 15), hi = d * (float)(b[4 + j] >> 4);
    NOFUSE(lo); NOFUSE(hi);
    y[j] = lo + m, y[j + QK / 2] = hi + m;
  }
}

/* Sub-block s of a Q4_K / Q5_K super-block: D = d sc, DM = dmin mn (each rounded). */
static inline void k_scales(const uint8_t *b, float D[8], float DM[8]) {
  float d = h2f(b), dmin = h2f(b + 2);
  for (int s = 0; s < 8; s++) {
    int sc, mn;
    get_scale_min(b + 4, s, &sc, &mn);
    D[s] = d * (float)sc, DM[s] = dmin * (float)mn;
  }
}

static void deq_q4_k(float *y, const uint8_t *b) {
  float D[8], DM[8];
  k_scales(b, D, DM);
  const uint8_t *qs = b + 16;
  for (int i = 0; i < 4; i++)
    for (int l = 0; l < 32; l++) {
      float lo = D[2 * i] * (float)(qs[32 * i + l] & 15), hi = D[2 * i + 1] * (float)(qs[32 * i + l] >> 4);
      NOFUSE(lo); NOFUSE(hi);
      y[64 * i + l] = lo - DM[2 * i], y[64 * i + 32 + l] = hi - DM[2 * i + 1];
    }
}

static void deq_q5_k(float *y, const uint8_t *b) {
  float D[8], DM[8];
  k_scales(b, D, DM);
  const uint8_t *qh = b + 16, *qs = b + 48;
  for (int s = 0; s < 8; s++)
    for (int l = 0; l < 32; l++) {
      int q = ((s & 1) ? qs[32 * (s / 2) + l] >> 4 : qs[32 * (s / 2) + l] & 15) | ((qh[l] >> s) & 1) << 4;
      float v = D[s] * (float)q;
      NOFUSE(v);
      y[32 * s + l] = v - DM[s];
    }
}

static void deq_q6_k(float *y, const uint8_t *b) {
  const uint8_t *ql = b, *qh = b + 128;
  const int8_t *sc = (const int8_t *)(b + 192);
  float d = h2f(b + 208), D[16];
  for (int s = 0; s < 16; s++) D[s] = d * (float)sc[s];
  for (int h = 0; h < 2; h++)
    for (int i = 0; i < 4; i++)
      for (int l = 0; l < 32; l++) {
        int lo = ql[64 * h + 32 * (i & 1) + l], n = 128 * h + 32 * i + l;
        int q = ((i & 2) ? lo >> 4 : lo & 15) | ((qh[32 * h + l] >> (2 * i)) & 3) << 4;
        y[n] = D[n / 16] * (float)(q - 32);
      }
}

typedef void (*deq_block_fn)(float *y, const uint8_t *b);

static const struct {
  int64_t block;
  size_t bytes;
  deq_block_fn deq;
} FMT[TP_WEIGHT_FORMAT_END - TP_Q8_0] = {
    [TP_Q8_0 - TP_Q8_0] = {QK, 34, deq_q8_0},    [TP_Q4_0 - TP_Q8_0] = {QK, 18, deq_q4_0},
    [TP_Q4_1 - TP_Q8_0] = {QK, 20, deq_q4_1},    [TP_Q4_K - TP_Q8_0] = {QKK, 144, deq_q4_k},
    [TP_Q5_K - TP_Q8_0] = {QKK, 176, deq_q5_k},  [TP_Q6_K - TP_Q8_0] = {QKK, 210, deq_q6_k},
};

static inline float int8_row_scale(const void *row) {
  float s;
  memcpy(&s, row, 4);
  return s;
}

/* The row with block dequantizer deq (f a block format). */
static void dequant_blocks(tp_dtype_t f, deq_block_fn deq, float *y, const uint8_t *r, int64_t K) {
  int64_t blk = FMT[f - TP_Q8_0].block;
  size_t bb = FMT[f - TP_Q8_0].bytes;
  for (int64_t i = 0; i < K / blk; i++) deq(y + i * blk, r + (size_t)i * bb);
}

/* ------------------------------------------------------------------ quantization */

/* Round half away from zero, clamped to [lo, hi] first (NaN goes to lo: no UB in the cast). */
static inline int qround(float v, float lo, float hi) {
  v = v > lo ? v : lo; /* NaN: lo */
  v = v < hi ? v : hi;
  return (int)roundf(v);
}

/* llama.cpp's reference quantizers (gguf-py's quantize_blocks) step for step. */
static void quant_q8_0(uint8_t *b, const float *x) {
  float amax = 0;
  for (int j = 0; j < QK; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
  float d = amax / 127.0f, id = d != 0 ? 1.0f / d : 0.0f;
  f2h(b, d);
  for (int j = 0; j < QK; j++) b[2 + j] = (uint8_t)(int8_t)qround(x[j] * id, -127.0f, 127.0f);
}

static inline int trunc_clip15(float v) {
  v = v > 0 ? v : 0; /* NaN: 0 */
  v = v < 15 ? v : 15;
  return (int)v; /* truncation, as gguf-py's np.trunc then clip */
}

static void quant_q4_0(uint8_t *b, const float *x) {
  float amax = 0, max = 0;
  for (int j = 0; j < QK; j++)
    if (fabsf(x[j]) > amax) amax = fabsf(x[j]), max = x[j]; /* the first of the largest |x| */
  float d = max / -8.0f, id = d != 0 ? 1.0f / d : 0.0f;
  f2h(b, d);
  for (int j = 0; j < QK / 2; j++) {
    float v0 = x[j] * id, v1 = x[j + QK / 2] * id;
    NOFUSE(v0); NOFUSE(v1);
    b[2 + j] = (uint8_t)(trunc_clip15(v0 + 8.5f) | trunc_clip15(v1 + 8.5f) << 4);
  }
}

static void quant_q4_1(uint8_t *b, const float *x) {
  float max = x[0], min = x[0];
  for (int j = 1; j < QK; j++) max = x[j] > max ? x[j] : max, min = x[j] < min ? x[j] : min;
  float d = (max - min) / 15.0f, id = d != 0 ? 1.0f / d : 0.0f;
  f2h(b, d), f2h(b + 2, min);
  for (int j = 0; j < QK / 2; j++) {
    float v0 = (x[j] - min) * id, v1 = (x[j + QK / 2] - min) * id;
    NOFUSE(v0); NOFUSE(v1);
    b[4 + j] = (uint8_t)(trunc_clip15(v0 + 0.5f) | trunc_clip15(v1 + 0.5f) << 4);
  }
}

/* K-quants: each sub-block's (scale, min) by a small search, then the super-block's f16
 * d / dmin and the 6-bit (Q6_K: 8-bit signed) sub-block codes, each code chosen among its
 * neighbours by the sub-block's squared error with the codes' actual values.
 *
 * Affine sub-block (Q4_K, Q5_K): x ~ s q - m, q in [0, nmax], m >= 0 (the format subtracts
 * a non-negative dmin * mn).  For several step sizes spread around (max - lo) / nmax the
 * elements are rounded, and the least-squares (s, m) of those q is kept when its error is
 * the least. */
static void fit_affine(const float *x, int n, int nmax, float *scale, float *min) {
  float lo = x[0], hi = x[0];
  double sx = 0, sx2 = 0;
  for (int i = 0; i < n; i++) {
    lo = x[i] < lo ? x[i] : lo, hi = x[i] > hi ? x[i] : hi;
    sx += x[i], sx2 += (double)x[i] * x[i];
  }
  if (lo > 0) lo = 0;
  if (hi <= lo) { /* constant (non-positive) sub-block */
    *scale = 0, *min = -lo;
    return;
  }
  double best = INFINITY, bs = (hi - lo) / nmax, bm = -lo;
  for (int t = -6; t <= 10; t++) {
    float is = (nmax + 0.1f * t) / (hi - lo);
    int sq = 0, sq2 = 0;
    double sqx = 0;
    for (int i = 0; i < n; i++) { /* round half up: the argument is >= 0 */
      int q = (int)((x[i] - lo) * is + 0.5f);
      q = q < nmax ? q : nmax;
      sq += q, sq2 += q * q, sqx += q * (double)x[i];
    }
    double den = (double)n * sq2 - (double)sq * sq, s, off;
    if (den <= 0) continue;
    s = (n * sqx - sq * sx) / den, off = (sx - s * sq) / n; /* least squares: x ~ s q + off */
    if (off > 0) s = sq2 > 0 ? sqx / sq2 : 0, off = 0;       /* the format's offset is <= 0 */
    if (s <= 0) continue;
    /* sum (x - s q - off)^2 from the sums */
    double err = sx2 - 2 * s * sqx - 2 * off * sx + s * s * sq2 + 2 * s * off * sq + n * off * off;
    if (err < best) best = err, bs = s, bm = -off;
  }
  *scale = (float)bs, *min = (float)bm;
}

/* The squared error of sub-block x[n] coded with (D, DM): q = round((x + DM) / D) in [0, nmax]. */
static float affine_err(const float *x, int n, int nmax, float D, float DM, uint8_t *q) {
  float err = 0, id = D != 0 ? 1.0f / D : 0.0f;
  for (int i = 0; i < n; i++) {
    float v = (x[i] + DM) * id;
    v = v > 0 ? v : 0; /* (NaN: 0) */
    int c = (int)(v + 0.5f);
    c = c < nmax ? c : nmax;
    float e = x[i] - (D * (float)c - DM);
    if (q) q[i] = (uint8_t)c;
    err += e * e;
  }
  return err;
}

/* The Q4_K / Q5_K super-block's header (d, dmin, scales[12]) and its q[256] (0..nmax). */
static void quant_k_affine(uint8_t *hdr, uint8_t q[QKK], const float *x, int nmax) {
  float s[8], m[8], smax = 0, mmax = 0;
  for (int j = 0; j < 8; j++) {
    fit_affine(x + 32 * j, 32, nmax, &s[j], &m[j]);
    smax = s[j] > smax ? s[j] : smax, mmax = m[j] > mmax ? m[j] : mmax;
  }
  float d = round_half(smax / 63.0f), dmin = round_half(mmax / 63.0f);
  f2h(hdr, d), f2h(hdr + 2, dmin);
  int sc[8], mn[8];
  for (int j = 0; j < 8; j++) {
    int s0 = d > 0 ? qround(s[j] / d, 0, 63) : 0, m0 = dmin > 0 ? qround(m[j] / dmin, 0, 63) : 0;
    float best = INFINITY;
    sc[j] = s0, mn[j] = m0;
    for (int a = s0 - 1; a <= s0 + 1; a++)
      for (int c = m0 - 1; c <= m0 + 1; c++) {
        if (a < 0 || a > 63 || c < 0 || c > 63) continue;
        float e = affine_err(x + 32 * j, 32, nmax, d * (float)a, dmin * (float)c, NULL);
        if (e < best) best = e, sc[j] = a, mn[j] = c;
      }
    affine_err(x + 32 * j, 32, nmax, d * (float)sc[j], dmin * (float)mn[j], q + 32 * j);
  }
  uint8_t *S = hdr + 4; /* the 6-bit packing get_scale_min reads */
  for (int j = 0; j < 4; j++) {
    S[j] = (uint8_t)((sc[j] & 63) | (sc[j + 4] >> 4) << 6);
    S[j + 4] = (uint8_t)((mn[j] & 63) | (mn[j + 4] >> 4) << 6);
    S[j + 8] = (uint8_t)((sc[j + 4] & 15) | (mn[j + 4] & 15) << 4);
  }
}

static void quant_q4_k(uint8_t *b, const float *x) {
  uint8_t q[QKK];
  quant_k_affine(b, q, x, 15);
  for (int i = 0; i < 4; i++)
    for (int l = 0; l < 32; l++) b[16 + 32 * i + l] = (uint8_t)(q[64 * i + l] | q[64 * i + 32 + l] << 4);
}

static void quant_q5_k(uint8_t *b, const float *x) {
  uint8_t q[QKK];
  quant_k_affine(b, q, x, 31);
  memset(b + 16, 0, 32);
  for (int s = 0; s < 8; s++)
    for (int l = 0; l < 32; l++) b[16 + l] |= (uint8_t)((q[32 * s + l] >> 4) << s);
  for (int i = 0; i < 4; i++)
    for (int l = 0; l < 32; l++)
      b[48 + 32 * i + l] = (uint8_t)((q[64 * i + l] & 15) | (q[64 * i + 32 + l] & 15) << 4);
}

/* Symmetric sub-block (Q6_K): x ~ s q, q in [-32, 31].  Step sizes that put the largest
 * |x| at -32 or +31 and near them; the least-squares s of each rounding, the least error kept. */
static float fit_symmetric(const float *x, int n) {
  float amax = 0, xm = 0;
  double sx2 = 0;
  for (int i = 0; i < n; i++) {
    if (fabsf(x[i]) > amax) amax = fabsf(x[i]), xm = x[i];
    sx2 += (double)x[i] * x[i];
  }
  if (amax == 0) return 0;
  double best = INFINITY, bs = xm / -32.0;
  for (int sign = -1; sign <= 1; sign += 2)
    for (int t = -8; t <= 8; t++) {
      float is = (sign < 0 ? -(32 + 0.25f * t) : (31 + 0.25f * t)) / xm;
      int sq2 = 0;
      double sqx = 0;
      for (int i = 0; i < n; i++) {
        float v = x[i] * is;
        v = v > -32.5f ? v : -32.5f;
        int q = (int)(v + 32.5f) - 32; /* round half up, then clamp */
        q = q < 31 ? q : 31;
        sqx += q * (double)x[i], sq2 += q * q;
      }
      if (sq2 <= 0) continue;
      double s = sqx / sq2, err = sx2 - s * sqx; /* the error of the least-squares s */
      if (err < best) best = err, bs = s;
    }
  return (float)bs;
}

static float symmetric_err(const float *x, int n, float D, int8_t *q) {
  float err = 0, id = D != 0 ? 1.0f / D : 0.0f;
  for (int i = 0; i < n; i++) {
    float v = x[i] * id;
    v = v > -32.5f ? v : -32.5f; /* (NaN: -32.5) */
    int c = (int)(v + 32.5f) - 32;
    c = c < 31 ? c : 31;
    float e = x[i] - D * (float)c;
    if (q) q[i] = (int8_t)c;
    err += e * e;
  }
  return err;
}

static void quant_q6_k(uint8_t *b, const float *x) {
  float s[16], smax = 0, sabs = 0;
  for (int j = 0; j < 16; j++) {
    s[j] = fit_symmetric(x + 16 * j, 16);
    if (fabsf(s[j]) > sabs) sabs = fabsf(s[j]), smax = s[j];
  }
  /* the largest |scale| goes to -128 (int8's longer side) */
  float d = round_half(smax / -128.0f);
  f2h(b + 208, d);
  int8_t q[QKK], *sc = (int8_t *)(b + 192);
  for (int j = 0; j < 16; j++) {
    int c0 = d != 0 ? qround(s[j] / d, -128, 127) : 0;
    float best = INFINITY;
    sc[j] = (int8_t)c0;
    for (int c = c0 - 1; c <= c0 + 1; c++) {
      if (c < -128 || c > 127) continue;
      float e = symmetric_err(x + 16 * j, 16, d * (float)c, NULL);
      if (e < best) best = e, sc[j] = (int8_t)c;
    }
    symmetric_err(x + 16 * j, 16, d * (float)sc[j], q + 16 * j);
  }
  memset(b + 128, 0, 64);
  for (int h = 0; h < 2; h++)
    for (int i = 0; i < 4; i++)
      for (int l = 0; l < 32; l++) {
        int v = q[128 * h + 32 * i + l] + 32; /* 0..63 */
        uint8_t *lo = &b[64 * h + 32 * (i & 1) + l];
        if (i & 2) *lo = (uint8_t)(*lo | (v & 15) << 4);
        else *lo = (uint8_t)(v & 15);
        b[128 + 32 * h + l] |= (uint8_t)((v >> 4) << (2 * i));
      }
}

typedef void (*quant_block_fn)(uint8_t *b, const float *x);

static const quant_block_fn QUANT[TP_WEIGHT_FORMAT_END - TP_Q8_0] = {
    [TP_Q8_0 - TP_Q8_0] = quant_q8_0, [TP_Q4_0 - TP_Q8_0] = quant_q4_0, [TP_Q4_1 - TP_Q8_0] = quant_q4_1,
    [TP_Q4_K - TP_Q8_0] = quant_q4_k, [TP_Q5_K - TP_Q8_0] = quant_q5_k, [TP_Q6_K - TP_Q8_0] = quant_q6_k,
};

void tp_q_quant_row(tp_dtype_t f, void *row, const float *x, int64_t K) {
  uint8_t *r = row;
  if (f == TP_INT8) {
    float amax = 0;
    for (int64_t k = 0; k < K; k++) amax = fabsf(x[k]) > amax ? fabsf(x[k]) : amax;
    float s = amax / 127.0f;
    memcpy(r, &s, 4);
    for (int64_t k = 0; k < K; k++) r[4 + k] = (uint8_t)(int8_t)(s != 0 ? qround(x[k] / s, -127.0f, 127.0f) : 0);
    return;
  }
  if (!tp_q_format(f)) return;
  int64_t blk = FMT[f - TP_Q8_0].block;
  size_t bb = FMT[f - TP_Q8_0].bytes;
  for (int64_t i = 0; i < K / blk; i++) QUANT[f - TP_Q8_0](r + (size_t)i * bb, x + i * blk);
}

/* ------------------------------------------------------------------ portable dot kernels */

/* sum_k x[k] w[k] over n (a multiple of 8) in eight partial sums: a fixed order GCC
 * vectorizes (baseline SSE2) without reassociating anything. */
static inline float dot8(const float *x, const float *w, int64_t n) {
  float p[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t k = 0; k < n; k += 8)
    for (int l = 0; l < 8; l++) p[l] += x[k + l] * w[k + l];
  return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
}

/* A block dequantized (the scalar dequantizer), then its dot with x added to the total. */
static inline float dot1_blocks(tp_dtype_t f, const uint8_t *r, const float *x, int64_t K) {
  float w[QKK], acc = 0;
  int64_t blk = FMT[f - TP_Q8_0].block;
  size_t bb = FMT[f - TP_Q8_0].bytes;
  for (int64_t i = 0; i < K / blk; i++) {
    FMT[f - TP_Q8_0].deq(w, r + (size_t)i * bb);
    acc += dot8(x + i * blk, w, blk);
  }
  return acc;
}

static inline void dot4_blocks(tp_dtype_t f, float out[4], const uint8_t *r, const float *const x[4], int64_t K) {
  float w[QKK], acc[4] = {0, 0, 0, 0};
  int64_t blk = FMT[f - TP_Q8_0].block;
  size_t bb = FMT[f - TP_Q8_0].bytes;
  for (int64_t i = 0; i < K / blk; i++) {
    FMT[f - TP_Q8_0].deq(w, r + (size_t)i * bb);
    for (int j = 0; j < 4; j++) acc[j] += dot8(x[j] + i * blk, w, blk);
  }
  memcpy(out, acc, sizeof acc);
}

/* int8 rows: chunks of 256 (the block formats' largest block) widened, then the row's scale. */
static float dot1_int8_portable(const void *row, const float *x, int64_t K) {
  const int8_t *q = (const int8_t *)row + 4;
  float acc = 0, w[QKK];
  int64_t K8 = K & ~(int64_t)7;
  for (int64_t k0 = 0, n; k0 < K8; k0 += n) {
    n = K8 - k0 < QKK ? K8 - k0 : QKK;
    for (int64_t k = 0; k < n; k++) w[k] = (float)q[k0 + k];
    acc += dot8(x + k0, w, n);
  }
  for (int64_t k = K8; k < K; k++) acc += x[k] * (float)q[k];
  return acc * int8_row_scale(row);
}

static void dot4_int8_portable(float out[4], const void *row, const float *const x[4], int64_t K) {
  for (int j = 0; j < 4; j++) out[j] = dot1_int8_portable(row, x[j], K);
}

#define TP_Q_PORTABLE_(NAME, F)                                                                       \
  static float dot1_##NAME##_portable(const void *row, const float *x, int64_t K) {                   \
    return dot1_blocks(F, row, x, K);                                                                 \
  }                                                                                                   \
  static void dot4_##NAME##_portable(float out[4], const void *row, const float *const x[4], int64_t K) { \
    dot4_blocks(F, out, row, x, K);                                                                   \
  }
TP_Q_PORTABLE_(q8_0, TP_Q8_0)
TP_Q_PORTABLE_(q4_0, TP_Q4_0)
TP_Q_PORTABLE_(q4_1, TP_Q4_1)
TP_Q_PORTABLE_(q4_k, TP_Q4_K)
TP_Q_PORTABLE_(q5_k, TP_Q5_K)
TP_Q_PORTABLE_(q6_k, TP_Q6_K)
#undef TP_Q_PORTABLE_

/* ------------------------------------------------------------------ SIMD dot kernels */

/* Each format supplies, per ISA, PREP (the per-block values: scales, lookup tables) and
 * CHUNK (CE consecutive elements of the block dequantized into NVC vectors, in registers).
 * The drivers below multiply the vectors into accumulators: dot1 into four (two chunks in
 * flight when a chunk is two vectors), dot4 into two per row of x.  The order of every sum
 * depends on K only. */
#if TP_Q_X86

#define T512 __attribute__((target("avx512f,avx2,fma,f16c"), always_inline)) static inline
/* the loops over a chunk's vectors, rows of x, halves: unrolled at any -O (registers, not arrays) */
#define UNROLL _Pragma("GCC unroll 8")
#define T256 __attribute__((target("avx2,fma,f16c"), always_inline)) static inline

/* Q4_K / Q5_K: the 6-bit codes of a super-block as eight bytes each (see get_scale_min). */
static inline void unpack_k_scales(const uint8_t *s, uint64_t *sc, uint64_t *mn) {
  uint32_t s0, s1, s2;
  memcpy(&s0, s, 4), memcpy(&s1, s + 4, 4), memcpy(&s2, s + 8, 4);
  uint32_t sc_lo = s0 & 0x3f3f3f3fu, mn_lo = s1 & 0x3f3f3f3fu;
  uint32_t sc_hi = (s2 & 0x0f0f0f0fu) | ((s0 >> 2) & 0x30303030u);
  uint32_t mn_hi = ((s2 >> 4) & 0x0f0f0f0fu) | ((s1 >> 2) & 0x30303030u);
  *sc = sc_lo | (uint64_t)sc_hi << 32, *mn = mn_lo | (uint64_t)mn_hi << 32;
}

/* D[s] = d sc_s, M[s] = dmin mn_s of a Q4_K / Q5_K super-block (as the dequantizer rounds them). */
__attribute__((target("avx2,fma,f16c"))) static inline void k_scales_256(const uint8_t *b, float D[8], float M[8]) {
  uint64_t sc, mn;
  unpack_k_scales(b + 4, &sc, &mn);
  __m256 fs = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc)));
  __m256 fm = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn)));
  __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128((int)(b[0] | b[1] << 8 | b[2] << 16 | (uint32_t)b[3] << 24)));
  _mm256_storeu_ps(D, _mm256_mul_ps(_mm256_broadcastss_ps(dd), fs));
  _mm256_storeu_ps(M, _mm256_mul_ps(_mm256_permutevar8x32_ps(_mm256_castps128_ps256(dd), _mm256_set1_epi32(1)), fm));
}

__attribute__((target("avx2,fma,f16c"))) static inline void q6_scales_256(const uint8_t *b, float D[16], float N[16]) {
  __m256 d = _mm256_set1_ps(_cvtsh_ss((unsigned short)(b[208] | b[209] << 8)));
  UNROLL for (int h = 0; h < 2; h++) {
    __m256 s = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 192 + 8 * h))));
    __m256 v = _mm256_mul_ps(d, s);
    _mm256_storeu_ps(D + 8 * h, v);
    _mm256_storeu_ps(N + 8 * h, _mm256_mul_ps(v, _mm256_set1_ps(-32.0f))); /* exact */
  }
}

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

/* ---------------------------------------------- AVX-512F: 16 lanes; 4-bit codes index a
 * 16-entry table of the block's values (vpermps uses the low 4 bits of each index) */

typedef struct {
  __m512 t;
  float D[16], M[16];
  __m512i h0, h1;
} p512;

#define IOTA512 _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
#define LD128(p) _mm_loadu_si128((const __m128i *)(p))

T512 void q8_0_prep512(const uint8_t *b, p512 *p) { p->t = _mm512_set1_ps(_cvtsh_ss(rd16(b))); }
T512 void q8_0_chunk512(const uint8_t *b, const p512 *p, int c, __m512 w[2]) {
  (void)c;
  w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(LD128(b + 2))), p->t);
  w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(LD128(b + 18))), p->t);
}

T512 void q4_0_prep512(const uint8_t *b, p512 *p) {
  p->t = _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(rd16(b))), _mm512_sub_ps(IOTA512, _mm512_set1_ps(8)));
}
T512 void q4_0_chunk512(const uint8_t *b, const p512 *p, int c, __m512 w[2]) {
  (void)c;
  __m512i q = _mm512_cvtepu8_epi32(LD128(b + 2));
  w[0] = _mm512_permutexvar_ps(q, p->t);
  w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), p->t);
}

T512 void q4_1_prep512(const uint8_t *b, p512 *p) {
  p->t = _mm512_fmadd_ps(_mm512_set1_ps(_cvtsh_ss(rd16(b))), IOTA512, _mm512_set1_ps(_cvtsh_ss(rd16(b + 2))));
}
T512 void q4_1_chunk512(const uint8_t *b, const p512 *p, int c, __m512 w[2]) {
  (void)c;
  __m512i q = _mm512_cvtepu8_epi32(LD128(b + 4));
  w[0] = _mm512_permutexvar_ps(q, p->t);
  w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), p->t);
}

T512 void q4_k_prep512(const uint8_t *b, p512 *p) { k_scales_256(b, p->D, p->M); }
/* chunk c: sub-blocks 2c (low nibbles of qs[32c..32c+31]) and 2c+1 (high nibbles) */
T512 void q4_k_chunk512(const uint8_t *b, const p512 *p, int c, __m512 w[4]) {
  __m512 t0 = _mm512_fmsub_ps(_mm512_set1_ps(p->D[2 * c]), IOTA512, _mm512_set1_ps(p->M[2 * c]));
  __m512 t1 = _mm512_fmsub_ps(_mm512_set1_ps(p->D[2 * c + 1]), IOTA512, _mm512_set1_ps(p->M[2 * c + 1]));
  __m512i qa = _mm512_cvtepu8_epi32(LD128(b + 16 + 32 * c)), qb = _mm512_cvtepu8_epi32(LD128(b + 32 + 32 * c));
  w[0] = _mm512_permutexvar_ps(qa, t0), w[1] = _mm512_permutexvar_ps(qb, t0);
  w[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(qa, 4), t1), w[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(qb, 4), t1);
}

T512 void q5_k_prep512(const uint8_t *b, p512 *p) {
  k_scales_256(b, p->D, p->M);
  p->h0 = _mm512_slli_epi32(_mm512_cvtepu8_epi32(LD128(b + 16)), 4); /* bit s of qh at bit 4 + s */
  p->h1 = _mm512_slli_epi32(_mm512_cvtepu8_epi32(LD128(b + 32)), 4);
}
/* 5-bit codes: bit 4 of the index (vpermt2ps's table select) from qh, 0xD8 = (C ? B : A) */
T512 void q5_k_chunk512(const uint8_t *b, const p512 *p, int c, __m512 w[4]) {
  const __m512i bit4 = _mm512_set1_epi32(16);
  const __m512 iota16 = _mm512_add_ps(IOTA512, _mm512_set1_ps(16));
  UNROLL for (int h = 0; h < 2; h++) {
    int s = 2 * c + h;
    __m512 D = _mm512_set1_ps(p->D[s]), M = _mm512_set1_ps(p->M[s]);
    __m512 lo = _mm512_fmsub_ps(D, IOTA512, M), hi = _mm512_fmsub_ps(D, iota16, M);
    __m512i qa = _mm512_cvtepu8_epi32(LD128(b + 48 + 32 * c)), qb = _mm512_cvtepu8_epi32(LD128(b + 64 + 32 * c));
    if (h) qa = _mm512_srli_epi32(qa, 4), qb = _mm512_srli_epi32(qb, 4);
    __m128i cnt = _mm_cvtsi32_si128(s);
    __m512i ia = _mm512_ternarylogic_epi32(qa, _mm512_srl_epi32(p->h0, cnt), bit4, 0xD8);
    __m512i ib = _mm512_ternarylogic_epi32(qb, _mm512_srl_epi32(p->h1, cnt), bit4, 0xD8);
    w[2 * h] = _mm512_permutex2var_ps(lo, ia, hi), w[2 * h + 1] = _mm512_permutex2var_ps(lo, ib, hi);
  }
}

T512 void q6_k_prep512(const uint8_t *b, p512 *p) { q6_scales_256(b, p->D, p->M); }
/* chunk c: elements 32c..32c+31 (h = c / 4, i = c % 4 of the layout), sub-blocks 2c, 2c+1 */
T512 void q6_k_chunk512(const uint8_t *b, const p512 *p, int c, __m512 w[2]) {
  int h = c >> 2, i = c & 3;
  const uint8_t *ql = b + 64 * h + 32 * (i & 1), *qh = b + 128 + 32 * h;
  __m128i cnt = _mm_cvtsi32_si128(2 * i);
  const __m512i m15 = _mm512_set1_epi32(15), m48 = _mm512_set1_epi32(48);
  UNROLL for (int v = 0; v < 2; v++) {
    __m512i l = _mm512_cvtepu8_epi32(LD128(ql + 16 * v));
    l = (i & 2) ? _mm512_srli_epi32(l, 4) : _mm512_and_si512(l, m15);
    __m512i hb = _mm512_srl_epi32(_mm512_slli_epi32(_mm512_cvtepu8_epi32(LD128(qh + 16 * v)), 4), cnt);
    __m512 q = _mm512_cvtepi32_ps(_mm512_ternarylogic_epi32(l, hb, m48, 0xF8)); /* A | (B & C) */
    w[v] = _mm512_fmadd_ps(_mm512_set1_ps(p->D[2 * c + v]), q, _mm512_set1_ps(p->M[2 * c + v]));
  }
}

/* ---------------------------------------------- AVX2 + FMA + F16C: 8 lanes, codes converted */

typedef struct {
  __m256 t, u;
  float D[16], M[16];
} p256;

#define LD64(p) _mm_loadl_epi64((const __m128i *)(p))
#define U8X8(p) _mm256_cvtepu8_epi32(LD64(p))

T256 void q8_0_prep256(const uint8_t *b, p256 *p) { p->t = _mm256_set1_ps(_cvtsh_ss(rd16(b))); }
T256 void q8_0_chunk256(const uint8_t *b, const p256 *p, int c, __m256 w[4]) {
  (void)c;
  UNROLL for (int v = 0; v < 4; v++)
    w[v] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(LD64(b + 2 + 8 * v))), p->t);
}

/* 4-bit blocks: w = t q + u */
T256 void nib32_chunk256(const uint8_t *qs, const p256 *p, __m256 w[4]) {
  const __m256i m15 = _mm256_set1_epi32(15);
  __m256i qa = U8X8(qs), qb = U8X8(qs + 8);
  w[0] = _mm256_fmadd_ps(p->t, _mm256_cvtepi32_ps(_mm256_and_si256(qa, m15)), p->u);
  w[1] = _mm256_fmadd_ps(p->t, _mm256_cvtepi32_ps(_mm256_and_si256(qb, m15)), p->u);
  w[2] = _mm256_fmadd_ps(p->t, _mm256_cvtepi32_ps(_mm256_srli_epi32(qa, 4)), p->u);
  w[3] = _mm256_fmadd_ps(p->t, _mm256_cvtepi32_ps(_mm256_srli_epi32(qb, 4)), p->u);
}

T256 void q4_0_prep256(const uint8_t *b, p256 *p) {
  float d = _cvtsh_ss(rd16(b));
  p->t = _mm256_set1_ps(d), p->u = _mm256_set1_ps(-8.0f * d);
}
T256 void q4_0_chunk256(const uint8_t *b, const p256 *p, int c, __m256 w[4]) { (void)c, nib32_chunk256(b + 2, p, w); }

T256 void q4_1_prep256(const uint8_t *b, p256 *p) {
  p->t = _mm256_set1_ps(_cvtsh_ss(rd16(b))), p->u = _mm256_set1_ps(_cvtsh_ss(rd16(b + 2)));
}
T256 void q4_1_chunk256(const uint8_t *b, const p256 *p, int c, __m256 w[4]) { (void)c, nib32_chunk256(b + 4, p, w); }

T256 void q4_k_prep256(const uint8_t *b, p256 *p) { k_scales_256(b, p->D, p->M); }
/* chunk c: sub-block c (nibble c % 2 of qs[32 (c / 2) ...]) */
T256 void q4_k_chunk256(const uint8_t *b, const p256 *p, int c, __m256 w[4]) {
  const __m256i m15 = _mm256_set1_epi32(15);
  __m256 D = _mm256_set1_ps(p->D[c]), M = _mm256_set1_ps(p->M[c]);
  UNROLL for (int v = 0; v < 4; v++) {
    __m256i q = U8X8(b + 16 + 32 * (c >> 1) + 8 * v);
    q = (c & 1) ? _mm256_srli_epi32(q, 4) : _mm256_and_si256(q, m15);
    w[v] = _mm256_fmsub_ps(D, _mm256_cvtepi32_ps(q), M);
  }
}

T256 void q5_k_prep256(const uint8_t *b, p256 *p) { k_scales_256(b, p->D, p->M); }
T256 void q5_k_chunk256(const uint8_t *b, const p256 *p, int c, __m256 w[4]) {
  const __m256i m15 = _mm256_set1_epi32(15), bit4 = _mm256_set1_epi32(16);
  __m256 D = _mm256_set1_ps(p->D[c]), M = _mm256_set1_ps(p->M[c]);
  __m128i cnt = _mm_cvtsi32_si128(c);
  UNROLL for (int v = 0; v < 4; v++) {
    __m256i q = U8X8(b + 48 + 32 * (c >> 1) + 8 * v);
    q = (c & 1) ? _mm256_srli_epi32(q, 4) : _mm256_and_si256(q, m15);
    __m256i hb = _mm256_and_si256(_mm256_srl_epi32(_mm256_slli_epi32(U8X8(b + 16 + 8 * v), 4), cnt), bit4);
    w[v] = _mm256_fmsub_ps(D, _mm256_cvtepi32_ps(_mm256_or_si256(q, hb)), M);
  }
}

T256 void q6_k_prep256(const uint8_t *b, p256 *p) { q6_scales_256(b, p->D, p->M); }
T256 void q6_k_chunk256(const uint8_t *b, const p256 *p, int c, __m256 w[4]) {
  int h = c >> 2, i = c & 3;
  const uint8_t *ql = b + 64 * h + 32 * (i & 1), *qh = b + 128 + 32 * h;
  __m128i cnt = _mm_cvtsi32_si128(2 * i);
  const __m256i m15 = _mm256_set1_epi32(15), m48 = _mm256_set1_epi32(48);
  UNROLL for (int v = 0; v < 4; v++) {
    __m256i l = U8X8(ql + 8 * v);
    l = (i & 2) ? _mm256_srli_epi32(l, 4) : _mm256_and_si256(l, m15);
    __m256i hb = _mm256_and_si256(_mm256_srl_epi32(_mm256_slli_epi32(U8X8(qh + 8 * v), 4), cnt), m48);
    __m256 q = _mm256_cvtepi32_ps(_mm256_or_si256(l, hb));
    w[v] = _mm256_fmadd_ps(_mm256_set1_ps(p->D[2 * c + v / 2]), q, _mm256_set1_ps(p->M[2 * c + v / 2]));
  }
}

__attribute__((target("avx2,fma"))) static inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

/* The drivers: BLK elements and BB bytes a block, CE elements (NVC vectors) a chunk. */
#define TP_Q_DRIVERS_(NAME, ISA, TARGET, VEC, PT, LANES, ZERO, FMA, ADD, LOADX, HSUM, BLK, BB, CE)                \
  __attribute__((target(TARGET))) static float dot1_##NAME##_##ISA(const void *row, const float *x,       \
                                                                           int64_t K) {                         \
    enum { NVC = (CE) / (LANES), CPB = (BLK) / (CE) };                                                          \
    const uint8_t *r = row;                                                                                     \
    VEC acc[4] = {ZERO, ZERO, ZERO, ZERO}, w[NVC];                                                              \
    PT p;                                                                                                       \
    int64_t nch = K / (CE), g = 0;                                                                              \
    for (; g + 2 <= nch; g += 2) {                                                                              \
      const uint8_t *b = r + (size_t)(g / CPB) * (BB);                                                          \
      const float *xg = x + g * (CE);                                                                           \
      if (g % CPB == 0) NAME##_prep##ISA(b, &p);                                                                \
      NAME##_chunk##ISA(b, &p, (int)(g % CPB), w);                                                              \
      UNROLL for (int v = 0; v < NVC; v++) acc[v & 3] = FMA(w[v], LOADX(xg + v * (LANES)), acc[v & 3]);              \
      if (CPB == 1) b += (BB), NAME##_prep##ISA(b, &p);                                                         \
      NAME##_chunk##ISA(b, &p, (int)((g + 1) % CPB), w);                                                        \
      UNROLL for (int v = 0; v < NVC; v++)                                                                             \
        acc[(v + NVC) & 3] = FMA(w[v], LOADX(xg + (CE) + v * (LANES)), acc[(v + NVC) & 3]);                    \
    }                                                                                                           \
    if (g < nch) {                                                                                              \
      const uint8_t *b = r + (size_t)(g / CPB) * (BB);                                                          \
      if (g % CPB == 0) NAME##_prep##ISA(b, &p);                                                                \
      NAME##_chunk##ISA(b, &p, (int)(g % CPB), w);                                                              \
      UNROLL for (int v = 0; v < NVC; v++) acc[v & 3] = FMA(w[v], LOADX(x + g * (CE) + v * (LANES)), acc[v & 3]);   \
    }                                                                                                           \
    return HSUM(ADD(ADD(acc[0], acc[1]), ADD(acc[2], acc[3])));                                                 \
  }                                                                                                             \
  __attribute__((target(TARGET))) static void dot4_##NAME##_##ISA(float out[4], const void *row,                  \
                                                                   const float *const x[4], int64_t K) {         \
    enum { NVC = (CE) / (LANES), CPB = (BLK) / (CE) };                                                          \
    const uint8_t *r = row;                                                                                     \
    VEC acc[4][2] = {{ZERO, ZERO}, {ZERO, ZERO}, {ZERO, ZERO}, {ZERO, ZERO}}, w[NVC];                           \
    PT p;                                                                                                       \
    int64_t nch = K / (CE);                                                                                     \
    for (int64_t g = 0; g < nch; g++) {                                                                         \
      const uint8_t *b = r + (size_t)(g / CPB) * (BB);                                                          \
      if (g % CPB == 0) NAME##_prep##ISA(b, &p);                                                                \
      NAME##_chunk##ISA(b, &p, (int)(g % CPB), w);                                                              \
      UNROLL for (int v = 0; v < NVC; v++)                                                                             \
        UNROLL for (int j = 0; j < 4; j++)                                                                             \
          acc[j][v & 1] = FMA(w[v], LOADX(x[j] + g * (CE) + v * (LANES)), acc[j][v & 1]);                       \
    }                                                                                                           \
    UNROLL for (int j = 0; j < 4; j++) out[j] = HSUM(ADD(acc[j][0], acc[j][1]));                                       \
  }

#define TP_Q512_(NAME, BLK, BB, CE)                                                                             \
  TP_Q_DRIVERS_(NAME, 512, "avx512f,avx2,fma,f16c", __m512, p512, 16, _mm512_setzero_ps(), _mm512_fmadd_ps,    \
                _mm512_add_ps, _mm512_loadu_ps, _mm512_reduce_add_ps, BLK, BB, CE)
#define TP_Q256_(NAME, BLK, BB, CE)                                                                             \
  TP_Q_DRIVERS_(NAME, 256, "avx2,fma,f16c", __m256, p256, 8, _mm256_setzero_ps(), _mm256_fmadd_ps,             \
                _mm256_add_ps, _mm256_loadu_ps, hsum256, BLK, BB, CE)
TP_Q512_(q8_0, 32, 34, 32)
TP_Q512_(q4_0, 32, 18, 32)
TP_Q512_(q4_1, 32, 20, 32)
TP_Q512_(q4_k, 256, 144, 64)
TP_Q512_(q5_k, 256, 176, 64)
TP_Q512_(q6_k, 256, 210, 32)
TP_Q256_(q8_0, 32, 34, 32)
TP_Q256_(q4_0, 32, 18, 32)
TP_Q256_(q4_1, 32, 20, 32)
TP_Q256_(q4_k, 256, 144, 32)
TP_Q256_(q5_k, 256, 176, 32)
TP_Q256_(q6_k, 256, 210, 32)
#undef TP_Q512_
#undef TP_Q256_
#undef TP_Q_DRIVERS_

/* int8 rows: any K; 64 elements per step into four accumulators, then 16 (8) at a time, then
 * one at a time; the row's scale multiplies the sum. */
__attribute__((target("avx512f,avx2,fma,f16c"))) static float dot1_int8_512(const void *row, const float *x, int64_t K) {
  const int8_t *q = (const int8_t *)row + 4;
  __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t k = 0;
  for (; k + 64 <= K; k += 64)
    UNROLL for (int v = 0; v < 4; v++)
      a[v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(LD128(q + k + 16 * v))),
                             _mm512_loadu_ps(x + k + 16 * v), a[v]);
  for (; k + 16 <= K; k += 16)
    a[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(LD128(q + k))), _mm512_loadu_ps(x + k), a[0]);
  float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
  for (; k < K; k++) s += x[k] * (float)q[k];
  return s * int8_row_scale(row);
}

__attribute__((target("avx512f,avx2,fma,f16c"))) static void dot4_int8_512(float out[4], const void *row,
                                                                           const float *const x[4], int64_t K) {
  const int8_t *q = (const int8_t *)row + 4;
  __m512 a[4][2];
  UNROLL for (int j = 0; j < 4; j++) a[j][0] = a[j][1] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32)
    UNROLL for (int v = 0; v < 2; v++) {
      __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(LD128(q + k + 16 * v)));
      UNROLL for (int j = 0; j < 4; j++) a[j][v] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x[j] + k + 16 * v), a[j][v]);
    }
  for (; k + 16 <= K; k += 16) {
    __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(LD128(q + k)));
    UNROLL for (int j = 0; j < 4; j++) a[j][0] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x[j] + k), a[j][0]);
  }
  float s[4];
  UNROLL for (int j = 0; j < 4; j++) s[j] = _mm512_reduce_add_ps(_mm512_add_ps(a[j][0], a[j][1]));
  for (; k < K; k++)
    UNROLL for (int j = 0; j < 4; j++) s[j] += x[j][k] * (float)q[k];
  UNROLL for (int j = 0; j < 4; j++) out[j] = s[j] * int8_row_scale(row);
}

__attribute__((target("avx2,fma,f16c"))) static float dot1_int8_256(const void *row, const float *x, int64_t K) {
  const int8_t *q = (const int8_t *)row + 4;
  __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t k = 0;
  for (; k + 32 <= K; k += 32)
    UNROLL for (int v = 0; v < 4; v++)
      a[v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(LD64(q + k + 8 * v))),
                             _mm256_loadu_ps(x + k + 8 * v), a[v]);
  for (; k + 8 <= K; k += 8)
    a[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(LD64(q + k))), _mm256_loadu_ps(x + k), a[0]);
  float s = hsum256(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
  for (; k < K; k++) s += x[k] * (float)q[k];
  return s * int8_row_scale(row);
}

__attribute__((target("avx2,fma,f16c"))) static void dot4_int8_256(float out[4], const void *row,
                                                                   const float *const x[4], int64_t K) {
  const int8_t *q = (const int8_t *)row + 4;
  __m256 a[4][2];
  UNROLL for (int j = 0; j < 4; j++) a[j][0] = a[j][1] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16)
    UNROLL for (int v = 0; v < 2; v++) {
      __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(LD64(q + k + 8 * v)));
      UNROLL for (int j = 0; j < 4; j++) a[j][v] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x[j] + k + 8 * v), a[j][v]);
    }
  for (; k + 8 <= K; k += 8) {
    __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(LD64(q + k)));
    UNROLL for (int j = 0; j < 4; j++) a[j][0] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x[j] + k), a[j][0]);
  }
  float s[4];
  UNROLL for (int j = 0; j < 4; j++) s[j] = hsum256(_mm256_add_ps(a[j][0], a[j][1]));
  for (; k < K; k++)
    UNROLL for (int j = 0; j < 4; j++) s[j] += x[j][k] * (float)q[k];
  UNROLL for (int j = 0; j < 4; j++) out[j] = s[j] * int8_row_scale(row);
}
/* ------------------------------------------------------------------ SIMD dequantization */

/* The dequantizers again, 16 / 8 elements at a time: the same float32 products and sums as
 * the scalar ones (each product rounded before its sum: NOFUSEV), so bit for bit equal to
 * them and to gguf-py (test_kernels_quant.c checks every level against the scalar one). */
#define NOFUSEV(v) __asm__("" : "+v"(v))

__attribute__((target("avx512f,avx2,fma,f16c"))) static void deq512_q8_0(float *y, const uint8_t *b) {
  __m512 d = _mm512_set1_ps(_cvtsh_ss(rd16(b)));
  UNROLL for (int v = 0; v < 2; v++)
    _mm512_storeu_ps(y + 16 * v, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(LD128(b + 2 + 16 * v))), d));
}

__attribute__((target("avx512f,avx2,fma,f16c"))) static void deq512_q4_0(float *y, const uint8_t *b) {
  __m512 d = _mm512_set1_ps(_cvtsh_ss(rd16(b)));
  __m512i q = _mm512_cvtepu8_epi32(LD128(b + 2)), eight = _mm512_set1_epi32(8);
  __m512i lo = _mm512_sub_epi32(_mm512_and_si512(q, _mm512_set1_epi32(15)), eight);
  __m512i hi = _mm512_sub_epi32(_mm512_srli_epi32(q, 4), eight);
  _mm512_storeu_ps(y, _mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)));
  _mm512_storeu_ps(y + 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(hi)));
}

__attribute__((target("avx512f,avx2,fma,f16c"))) static void deq512_q4_1(float *y, const uint8_t *b) {
  __m512 d = _mm512_set1_ps(_cvtsh_ss(rd16(b))), m = _mm512_set1_ps(_cvtsh_ss(rd16(b + 2)));
  __m512i q = _mm512_cvtepu8_epi32(LD128(b + 4));
  __m512 lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15))));
  __m512 hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)));
  NOFUSEV(lo);
  NOFUSEV(hi);
  _mm512_storeu_ps(y, _mm512_add_ps(lo, m));
  _mm512_storeu_ps(y + 16, _mm512_add_ps(hi, m));
}

/* Q4_K / Q5_K: 16 elements of sub-block s from their codes */
__attribute__((target("avx512f,avx2,fma,f16c"), always_inline)) static inline void kstore512(float *y, __m512i q,
                                                                                           float D, float DM) {
  __m512 v = _mm512_mul_ps(_mm512_set1_ps(D), _mm512_cvtepi32_ps(q));
  NOFUSEV(v);
  _mm512_storeu_ps(y, _mm512_sub_ps(v, _mm512_set1_ps(DM)));
}

__attribute__((target("avx512f,avx2,fma,f16c"))) static void deq512_q4_k(float *y, const uint8_t *b) {
  float D[8], M[8];
  k_scales_256(b, D, M);
  const __m512i m15 = _mm512_set1_epi32(15);
  UNROLL for (int i = 0; i < 4; i++) {
    __m512i qa = _mm512_cvtepu8_epi32(LD128(b + 16 + 32 * i)), qb = _mm512_cvtepu8_epi32(LD128(b + 32 + 32 * i));
    kstore512(y + 64 * i, _mm512_and_si512(qa, m15), D[2 * i], M[2 * i]);
    kstore512(y + 64 * i + 16, _mm512_and_si512(qb, m15), D[2 * i], M[2 * i]);
    kstore512(y + 64 * i + 32, _mm512_srli_epi32(qa, 4), D[2 * i + 1], M[2 * i + 1]);
    kstore512(y + 64 * i + 48, _mm512_srli_epi32(qb, 4), D[2 * i + 1], M[2 * i + 1]);
  }
}

__attribute__((target("avx512f,avx2,fma,f16c"))) static void deq512_q5_k(float *y, const uint8_t *b) {
  float D[8], M[8];
  k_scales_256(b, D, M);
  const __m512i m15 = _mm512_set1_epi32(15), one = _mm512_set1_epi32(1);
  __m512i h[2] = {_mm512_cvtepu8_epi32(LD128(b + 16)), _mm512_cvtepu8_epi32(LD128(b + 32))};
  for (int s = 0; s < 8; s++) {
    __m128i cnt = _mm_cvtsi32_si128(s);
    UNROLL for (int v = 0; v < 2; v++) {
      __m512i q = _mm512_cvtepu8_epi32(LD128(b + 48 + 32 * (s / 2) + 16 * v));
      q = (s & 1) ? _mm512_srli_epi32(q, 4) : _mm512_and_si512(q, m15);
      q = _mm512_or_si512(q, _mm512_slli_epi32(_mm512_and_si512(_mm512_srl_epi32(h[v], cnt), one), 4));
      kstore512(y + 32 * s + 16 * v, q, D[s], M[s]);
    }
  }
}

__attribute__((target("avx512f,avx2,fma,f16c"))) static void deq512_q6_k(float *y, const uint8_t *b) {
  float D[16], N[16];
  q6_scales_256(b, D, N);
  const __m512i m15 = _mm512_set1_epi32(15), three = _mm512_set1_epi32(3), k32 = _mm512_set1_epi32(32);
  UNROLL for (int h = 0; h < 2; h++)
    UNROLL for (int v = 0; v < 2; v++) {
      __m512i qh = _mm512_cvtepu8_epi32(LD128(b + 128 + 32 * h + 16 * v));
      __m512i la = _mm512_cvtepu8_epi32(LD128(b + 64 * h + 16 * v));      /* i = 0, 2 */
      __m512i lb = _mm512_cvtepu8_epi32(LD128(b + 64 * h + 32 + 16 * v)); /* i = 1, 3 */
      UNROLL for (int i = 0; i < 4; i++) {
        __m512i l = (i & 1) ? lb : la;
        l = (i & 2) ? _mm512_srli_epi32(l, 4) : _mm512_and_si512(l, m15);
        __m512i hb = _mm512_and_si512(_mm512_srl_epi32(qh, _mm_cvtsi32_si128(2 * i)), three);
        __m512i q = _mm512_sub_epi32(_mm512_or_si512(l, _mm512_slli_epi32(hb, 4)), k32);
        int n = 128 * h + 32 * i + 16 * v;
        _mm512_storeu_ps(y + n, _mm512_mul_ps(_mm512_set1_ps(D[n / 16]), _mm512_cvtepi32_ps(q)));
      }
    }
}

__attribute__((target("avx2,fma,f16c"))) static void deq256_q8_0(float *y, const uint8_t *b) {
  __m256 d = _mm256_set1_ps(_cvtsh_ss(rd16(b)));
  UNROLL for (int v = 0; v < 4; v++)
    _mm256_storeu_ps(y + 8 * v, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(LD64(b + 2 + 8 * v))), d));
}

__attribute__((target("avx2,fma,f16c"))) static void deq256_q4_0(float *y, const uint8_t *b) {
  __m256 d = _mm256_set1_ps(_cvtsh_ss(rd16(b)));
  const __m256i m15 = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
  UNROLL for (int v = 0; v < 2; v++) {
    __m256i q = U8X8(b + 2 + 8 * v);
    __m256i lo = _mm256_sub_epi32(_mm256_and_si256(q, m15), eight), hi = _mm256_sub_epi32(_mm256_srli_epi32(q, 4), eight);
    _mm256_storeu_ps(y + 8 * v, _mm256_mul_ps(d, _mm256_cvtepi32_ps(lo)));
    _mm256_storeu_ps(y + 16 + 8 * v, _mm256_mul_ps(d, _mm256_cvtepi32_ps(hi)));
  }
}

__attribute__((target("avx2,fma,f16c"))) static void deq256_q4_1(float *y, const uint8_t *b) {
  __m256 d = _mm256_set1_ps(_cvtsh_ss(rd16(b))), m = _mm256_set1_ps(_cvtsh_ss(rd16(b + 2)));
  const __m256i m15 = _mm256_set1_epi32(15);
  UNROLL for (int v = 0; v < 2; v++) {
    __m256i q = U8X8(b + 4 + 8 * v);
    __m256 lo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(q, m15)));
    __m256 hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)));
    NOFUSEV(lo);
    NOFUSEV(hi);
    _mm256_storeu_ps(y + 8 * v, _mm256_add_ps(lo, m));
    _mm256_storeu_ps(y + 16 + 8 * v, _mm256_add_ps(hi, m));
  }
}

__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void kstore256(float *y, __m256i q, float D,
                                                                                    float DM) {
  __m256 v = _mm256_mul_ps(_mm256_set1_ps(D), _mm256_cvtepi32_ps(q));
  NOFUSEV(v);
  _mm256_storeu_ps(y, _mm256_sub_ps(v, _mm256_set1_ps(DM)));
}

/* Q4_K (qh NULL) and Q5_K: sub-block s, 8 elements at a time */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void deq256_k(float *y, const uint8_t *b,
                                                                                   const uint8_t *qs,
                                                                                   const uint8_t *qh) {
  float D[8], M[8];
  k_scales_256(b, D, M);
  const __m256i m15 = _mm256_set1_epi32(15), one = _mm256_set1_epi32(1);
  for (int s = 0; s < 8; s++) {
    __m128i cnt = _mm_cvtsi32_si128(s);
    UNROLL for (int v = 0; v < 4; v++) {
      __m256i q = U8X8(qs + 32 * (s / 2) + 8 * v);
      q = (s & 1) ? _mm256_srli_epi32(q, 4) : _mm256_and_si256(q, m15);
      if (qh) q = _mm256_or_si256(q, _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(U8X8(qh + 8 * v), cnt), one), 4));
      kstore256(y + 32 * s + 8 * v, q, D[s], M[s]);
    }
  }
}

__attribute__((target("avx2,fma,f16c"))) static void deq256_q4_k(float *y, const uint8_t *b) { deq256_k(y, b, b + 16, NULL); }
__attribute__((target("avx2,fma,f16c"))) static void deq256_q5_k(float *y, const uint8_t *b) { deq256_k(y, b, b + 48, b + 16); }

__attribute__((target("avx2,fma,f16c"))) static void deq256_q6_k(float *y, const uint8_t *b) {
  float D[16], N[16];
  q6_scales_256(b, D, N);
  const __m256i m15 = _mm256_set1_epi32(15), three = _mm256_set1_epi32(3), k32 = _mm256_set1_epi32(32);
  UNROLL for (int h = 0; h < 2; h++)
    UNROLL for (int v = 0; v < 4; v++) {
      __m256i qh = U8X8(b + 128 + 32 * h + 8 * v), la = U8X8(b + 64 * h + 8 * v), lb = U8X8(b + 64 * h + 32 + 8 * v);
      UNROLL for (int i = 0; i < 4; i++) {
        __m256i l = (i & 1) ? lb : la;
        l = (i & 2) ? _mm256_srli_epi32(l, 4) : _mm256_and_si256(l, m15);
        __m256i hb = _mm256_and_si256(_mm256_srl_epi32(qh, _mm_cvtsi32_si128(2 * i)), three);
        __m256i q = _mm256_sub_epi32(_mm256_or_si256(l, _mm256_slli_epi32(hb, 4)), k32);
        int n = 128 * h + 32 * i + 8 * v;
        _mm256_storeu_ps(y + n, _mm256_mul_ps(_mm256_set1_ps(D[n / 16]), _mm256_cvtepi32_ps(q)));
      }
    }
}
#undef NOFUSEV

#endif

/* ------------------------------------------------------------------ dispatch */

typedef struct {
  tp_q_dot1_fn dot1;
  tp_q_dot4_fn dot4;
} q_kernels;

/* [format][isa]: isa 0 portable, 1 AVX2 + FMA + F16C, 2 AVX-512F (NULL: use the next narrower). */
#if TP_Q_X86
#define KERNELS_(N) {{dot1_##N##_portable, dot4_##N##_portable}, {dot1_##N##_256, dot4_##N##_256}, {dot1_##N##_512, dot4_##N##_512}}
#else
#define KERNELS_(N) {{dot1_##N##_portable, dot4_##N##_portable}}
#endif
static const q_kernels KERN[TP_WEIGHT_FORMAT_END][3] = {
    [TP_INT8] = KERNELS_(int8), [TP_Q8_0] = KERNELS_(q8_0), [TP_Q4_0] = KERNELS_(q4_0), [TP_Q4_1] = KERNELS_(q4_1),
    [TP_Q4_K] = KERNELS_(q4_k), [TP_Q5_K] = KERNELS_(q5_k), [TP_Q6_K] = KERNELS_(q6_k),
};
#undef KERNELS_

/* The widest level this CPU runs (checked once; a racing first call finds the same). */
int tp_q_cpu_isa(void) {
#if TP_Q_X86
  static int isa = -1;
  if (isa < 0) {
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    isa = avx2 && __builtin_cpu_supports("avx512f") ? 2 : avx2 ? 1 : 0;
  }
  return isa;
#else
  return 0;
#endif
}

static int q_isa(void) {
  int isa = tp_q_cpu_isa();
#ifdef TP_LOWP_MAX_ISA /* a build that tests the narrower kernels on a wider CPU: -DTP_LOWP_MAX_ISA=1 or 0 */
  if (isa > TP_LOWP_MAX_ISA) isa = TP_LOWP_MAX_ISA;
#endif
  return isa;
}

static const q_kernels *kernels_at(tp_dtype_t f, int isa) {
  if (!tp_q_format(f) || isa < 0 || isa > tp_q_cpu_isa()) return NULL;
  while (isa > 0 && !KERN[f][isa].dot1) isa--;
  return &KERN[f][isa];
}

/* [format][isa] block dequantizers (the scalar ones at level 0). */
#if TP_Q_X86
#define DEQ_(N) {deq_##N, deq256_##N, deq512_##N}
#else
#define DEQ_(N) {deq_##N}
#endif
static const deq_block_fn DEQ[TP_WEIGHT_FORMAT_END][3] = {
    [TP_Q8_0] = DEQ_(q8_0), [TP_Q4_0] = DEQ_(q4_0), [TP_Q4_1] = DEQ_(q4_1),
    [TP_Q4_K] = DEQ_(q4_k), [TP_Q5_K] = DEQ_(q5_k), [TP_Q6_K] = DEQ_(q6_k),
};
#undef DEQ_

int tp_q_dequant_row_at(tp_dtype_t f, float *y, const void *row, int64_t K, int isa) {
  if (!tp_q_format(f) || isa < 0 || isa > tp_q_cpu_isa()) return 0;
  const uint8_t *r = row;
  if (f == TP_INT8) { /* GCC vectorizes this loop at any level */
    float s = int8_row_scale(r);
    for (int64_t k = 0; k < K; k++) y[k] = s * (float)(int8_t)r[4 + k];
  } else {
    dequant_blocks(f, DEQ[f][isa], y, r, K);
  }
  return 1;
}

void tp_q_dequant_row(tp_dtype_t f, float *y, const void *row, int64_t K) { tp_q_dequant_row_at(f, y, row, K, q_isa()); }

tp_q_dot1_fn tp_q_dot1_for(tp_dtype_t f) {
  const q_kernels *k = kernels_at(f, q_isa());
  return k ? k->dot1 : NULL;
}

tp_q_dot4_fn tp_q_dot4_for(tp_dtype_t f) {
  const q_kernels *k = kernels_at(f, q_isa());
  return k ? k->dot4 : NULL;
}

tp_q_dot1_fn tp_q_dot1_at(tp_dtype_t f, int isa) {
  const q_kernels *k = kernels_at(f, isa);
  return k ? k->dot1 : NULL;
}

tp_q_dot4_fn tp_q_dot4_at(tp_dtype_t f, int isa) {
  const q_kernels *k = kernels_at(f, isa);
  return k ? k->dot4 : NULL;
}
