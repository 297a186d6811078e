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
#include "quant_x86.h"

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

static inline float h2f(const uint8_t *p) { return tp_half_to_float((uint16_t)(p[0] | p[1] << 8)); }

static inline void f2h(uint8_t *p, float f) {
  uint16_t h = tp_float_to_half(f);
  p[0] = (uint8_t)h, p[1] = (uint8_t)(h >> 8);
}

/* The float32 value of the f16 that f rounds to (what a reader of the stored field gets). */
static inline float round_half(float f) { return tp_half_to_float(tp_float_to_half(f)); }

int tp_q_format(tp_dtype_t f) { return tp_weight_is_quantized(f); /* dtype.c's list of formats */ }

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
    NOFUSE(lo);
    NOFUSE(hi);
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
      NOFUSE(lo);
      NOFUSE(hi);
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

static const struct {
  int64_t block;
  size_t bytes;
  deq_block_fn deq;
} FMT[TP_WEIGHT_FORMAT_END - TP_Q8_0] = {
    [TP_Q8_0 - TP_Q8_0] = {QK, 34, deq_q8_0},   [TP_Q4_0 - TP_Q8_0] = {QK, 18, deq_q4_0},
    [TP_Q4_1 - TP_Q8_0] = {QK, 20, deq_q4_1},   [TP_Q4_K - TP_Q8_0] = {QKK, 144, deq_q4_k},
    [TP_Q5_K - TP_Q8_0] = {QKK, 176, deq_q5_k}, [TP_Q6_K - TP_Q8_0] = {QKK, 210, deq_q6_k},
};

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
    NOFUSE(v0);
    NOFUSE(v1);
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
    NOFUSE(v0);
    NOFUSE(v1);
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
    if (off > 0) s = sq2 > 0 ? sqx / sq2 : 0, off = 0;      /* the format's offset is <= 0 */
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
    for (int l = 0; l < 32; l++) b[48 + 32 * i + l] = (uint8_t)((q[64 * i + l] & 15) | (q[64 * i + 32 + l] & 15) << 4);
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

#define TP_Q_PORTABLE_(NAME, F)                                                                           \
  static float dot1_##NAME##_portable(const void *row, const float *x, int64_t K) {                       \
    return dot1_blocks(F, row, x, K);                                                                     \
  }                                                                                                       \
  static void dot4_##NAME##_portable(float out[4], const void *row, const float *const x[4], int64_t K) { \
    dot4_blocks(F, out, row, x, K);                                                                       \
  }
TP_Q_PORTABLE_(q8_0, TP_Q8_0)
TP_Q_PORTABLE_(q4_0, TP_Q4_0)
TP_Q_PORTABLE_(q4_1, TP_Q4_1)
TP_Q_PORTABLE_(q4_k, TP_Q4_K)
TP_Q_PORTABLE_(q5_k, TP_Q5_K)
TP_Q_PORTABLE_(q6_k, TP_Q6_K)
#undef TP_Q_PORTABLE_

/* ------------------------------------------------------------------ dispatch */

/* [format]: the portable kernels (level 0); the x86 ones come from quant_x86.c. */
#define KERNELS_(N) {dot1_##N##_portable, dot4_##N##_portable, NULL}
static const tp_q_x86 PORTABLE[TP_WEIGHT_FORMAT_END] = {
    [TP_INT8] = KERNELS_(int8),
    [TP_Q8_0] = {dot1_q8_0_portable, dot4_q8_0_portable, deq_q8_0},
    [TP_Q4_0] = {dot1_q4_0_portable, dot4_q4_0_portable, deq_q4_0},
    [TP_Q4_1] = {dot1_q4_1_portable, dot4_q4_1_portable, deq_q4_1},
    [TP_Q4_K] = {dot1_q4_k_portable, dot4_q4_k_portable, deq_q4_k},
    [TP_Q5_K] = {dot1_q5_k_portable, dot4_q5_k_portable, deq_q5_k},
    [TP_Q6_K] = {dot1_q6_k_portable, dot4_q6_k_portable, deq_q6_k},
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

/* f's kernels at level isa (0 portable, 1 AVX2 + FMA + F16C, 2 AVX-512F), or NULL when f is
 * not a format of this file or this CPU does not run that level. */
static const tp_q_x86 *kernels_at(tp_dtype_t f, int isa) {
  if (!tp_q_format(f) || isa < 0 || isa > tp_q_cpu_isa()) return NULL;
#if TP_Q_X86
  if (isa > 0) return tp_q_x86_kernels(f, isa);
#endif
  return &PORTABLE[f];
}

int tp_q_dequant_row_at(tp_dtype_t f, float *y, const void *row, int64_t K, int isa) {
  if (!tp_q_format(f) || isa < 0 || isa > tp_q_cpu_isa()) return 0;
  const uint8_t *r = row;
  if (f == TP_INT8) { /* GCC vectorizes this loop at any level */
    float s = int8_row_scale(r);
    for (int64_t k = 0; k < K; k++) y[k] = s * (float)(int8_t)r[4 + k];
  } else {
    dequant_blocks(f, kernels_at(f, isa)->deq, y, r, K);
  }
  return 1;
}

void tp_q_dequant_row(tp_dtype_t f, float *y, const void *row, int64_t K) {
  tp_q_dequant_row_at(f, y, row, K, q_isa());
}

tp_q_dot1_fn tp_q_dot1_for(tp_dtype_t f) {
  const tp_q_x86 *k = kernels_at(f, q_isa());
  return k ? k->dot1 : NULL;
}

tp_q_dot4_fn tp_q_dot4_for(tp_dtype_t f) {
  const tp_q_x86 *k = kernels_at(f, q_isa());
  return k ? k->dot4 : NULL;
}

tp_q_dot1_fn tp_q_dot1_at(tp_dtype_t f, int isa) {
  const tp_q_x86 *k = kernels_at(f, isa);
  return k ? k->dot1 : NULL;
}

tp_q_dot4_fn tp_q_dot4_at(tp_dtype_t f, int isa) {
  const tp_q_x86 *k = kernels_at(f, isa);
  return k ? k->dot4 : NULL;
}
