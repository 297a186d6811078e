/* Low-precision weight storage on the CPU: bfloat16 / float16 weights, float32 arithmetic.
 *
 * The CPU has no fast 16-bit GEMM, so x stays float32 and w is widened (exactly: every
 * bfloat16 and float16 value is a float32 value):
 *   - decode-sized M (<= GEMV_MAX_M = 8 rows): a GEMV that reads each weight row once and widens
 *     it in registers (AVX-512F or AVX2+F16C+FMA, picked at run time; a portable loop
 *     otherwise), threads over output rows.  This path is memory-bound, and reading half the
 *     bytes of float32 is its whole point;
 *   - larger M: a panel of w rows is widened into the workspace and BLAS's sgemm runs on it,
 *     panel by panel (the widening is O(N K), the GEMM O(M N K)).
 * Conversions round to nearest even with branch-free bit arithmetic that GCC vectorizes for
 * each TP_VECTOR_CLONES target; the NaN encodings are those of NumPy's float16 cast (the
 * payload's top bits kept, made quiet) and ml_dtypes' bfloat16 cast (the quiet NaN of the
 * sign). */
#include <string.h>

#include "../../core/core_impl.h"
#include "../blas_impl.h"
#include "parallel.h"
#include "quant_impl.h"
#include "vmath.h"
#include "cpu_impl.h"

#if defined(__GNUC__) && defined(__x86_64__) && !defined(TP_NO_CLONES)
#define TP_LOWP_X86 1
#include <immintrin.h>
#endif

enum {
  /* up to this many rows of x the GEMV (w read once, four rows per pass) beats widening panels
   * for sgemm: measured on one AVX-512 core, K x N = 768 x 3072 and 2048 x 8192, the GEMV
   * took 0.45-0.6x the panel path's time at M = 6 and 8, 0.65-0.85x at 12, 1.1-1.3x at 16 */
  GEMV_MAX_M = 8,
  PANEL_BYTES = 8 << 20,  /* the float32 panel of w the GEMM path widens at a time */
  PANEL_MIN_ROWS = 16,    /* ... but never fewer rows than this (K beyond 128K) */
  CONVERT_CHUNK = 1 << 14 /* elements per parallel work item of convert */
};

/* ------------------------------------------------------------------ scalar rounding */

static inline uint32_t f2u(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static inline float u2f(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* Round to nearest even: add half an ulp of the result less one, plus the kept lowest bit.
 * The largest finite values round to the all-ones exponent, i.e. infinity. */
static inline uint16_t f32_to_bf16(uint32_t u) {
  uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t nan = ((u >> 16) & 0x8000u) | 0x7fc0u;
  return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : r);
}

static inline uint32_t bf16_to_f32(uint16_t h) { return (uint32_t)h << 16; }

/* float16: normal results rebias the exponent (-112 << 23) and round as above; below 2^-14
 * the float addition 0.5 + |x| rounds |x| to a multiple of 2^-24 (0.5's ulp, float16's
 * subnormal step) and the low bits of the sum are the result; at or above 65536 (and for
 * the values the rounding carries there) infinity; NaN keeps its top 9 payload bits below
 * the quiet bit, which it sets. */
static inline uint16_t f32_to_f16(uint32_t u) {
  uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  uint32_t norm = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;
  uint32_t sub = f2u(u2f(a) + 0.5f) - 0x3f000000u;
  uint32_t big = a > 0x7f800000u ? 0x7e00u | ((a >> 13) & 0x1ffu) : 0x7c00u;
  uint32_t r = a >= 0x47800000u ? big : a < 0x38800000u ? sub : norm;
  return (uint16_t)(sign | r);
}

static inline uint32_t f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, a = h & 0x7fffu;
  uint32_t r = a >= 0x7c00u   ? (a << 13) | 0x7f800000u /* inf, NaN (payload kept) */
               : a >= 0x0400u ? (a << 13) + 0x38000000u
                              : f2u((float)a * 0x1p-24f); /* subnormal or zero: exact */
  return sign | r;
}

/* ------------------------------------------------------------------ convert */

/* One vectorized loop per (to, from) pair: the compiler sees a fixed conversion. */
#define TP_CONVERT_LOOP_(NAME, TO, FROM, EXPR)                                           \
  TP_VECTOR_CLONES static void NAME(TO *restrict y, const FROM *restrict x, int64_t n) { \
    for (int64_t i = 0; i < n; i++) y[i] = EXPR;                                         \
  }
TP_CONVERT_LOOP_(cvt_f32_bf16, uint32_t, uint16_t, bf16_to_f32(x[i]))
TP_CONVERT_LOOP_(cvt_f32_f16, uint32_t, uint16_t, f16_to_f32(x[i]))
TP_CONVERT_LOOP_(cvt_bf16_f32, uint16_t, uint32_t, f32_to_bf16(x[i]))
TP_CONVERT_LOOP_(cvt_f16_f32, uint16_t, uint32_t, f32_to_f16(x[i]))
TP_CONVERT_LOOP_(cvt_f16_bf16, uint16_t, uint16_t, f32_to_f16(bf16_to_f32(x[i])))
TP_CONVERT_LOOP_(cvt_bf16_f16, uint16_t, uint16_t, f32_to_bf16(f16_to_f32(x[i])))
#undef TP_CONVERT_LOOP_

typedef void (*convert_fn)(void *y, const void *x, int64_t n);

static convert_fn convert_for(tp_dtype_t ydt, tp_dtype_t xdt) {
#define PAIR_(a, b) ((int)(a) * 16 + (int)(b))
  switch (PAIR_(ydt, xdt)) {
    case PAIR_(TP_FLOAT32, TP_BFLOAT16): return (convert_fn)cvt_f32_bf16;
    case PAIR_(TP_FLOAT32, TP_FLOAT16): return (convert_fn)cvt_f32_f16;
    case PAIR_(TP_BFLOAT16, TP_FLOAT32): return (convert_fn)cvt_bf16_f32;
    case PAIR_(TP_FLOAT16, TP_FLOAT32): return (convert_fn)cvt_f16_f32;
    case PAIR_(TP_FLOAT16, TP_BFLOAT16): return (convert_fn)cvt_f16_bf16;
    case PAIR_(TP_BFLOAT16, TP_FLOAT16): return (convert_fn)cvt_bf16_f16;
    default: return NULL;
  }
#undef PAIR_
}

static int lp_dtype(tp_dtype_t t) { return t == TP_BFLOAT16 || t == TP_FLOAT16; }

/* A 16-bit weight row widened to float32 (the panels and the portable paths). */
static void widen(float *y, const void *x, tp_dtype_t wdt, int64_t n) {
  (wdt == TP_BFLOAT16 ? (convert_fn)cvt_f32_bf16 : (convert_fn)cvt_f32_f16)(y, x, n);
}

/* Bytes of a weight row of K elements (K a multiple of the format's block: the layers
 * check it; this table's entries are not called otherwise). */
static size_t row_bytes(tp_dtype_t wdt, int64_t K) {
  size_t rb = 0;
  tp_weight_row_bytes(wdt, K, &rb);
  return rb;
}

/* Elements [k0, k0 + n) of a weight row of K elements as float32: k0 and n multiples of the
 * format's block (a 16-bit row: any). */
static void widen_span(float *y, const void *row, tp_dtype_t wdt, int64_t k0, int64_t n, int64_t K) {
  if (!tp_q_format(wdt)) {
    widen(y, (const uint16_t *)row + k0, wdt, n);
  } else if (wdt == TP_INT8) { /* a float32 scale, then K int8 */
    float sc;
    memcpy(&sc, row, 4);
    const int8_t *q = (const int8_t *)row + 4 + k0;
    for (int64_t i = 0; i < n; i++) y[i] = sc * (float)q[i];
  } else {
    int64_t blk;
    size_t bb, hdr;
    tp_weight_format(wdt, &blk, &bb, &hdr);
    tp_q_dequant_row(wdt, y, (const char *)row + (size_t)(k0 / blk) * bb, n);
  }
  (void)K;
}

typedef struct {
  convert_fn fn;
  char *y;
  const char *x;
  size_t ysz, xsz;
  int64_t n;
} convert_args;

static void convert_chunk(void *ctx, int64_t lo, int64_t hi, int chunk) {
  (void)chunk;
  const convert_args *a = ctx;
  int64_t i0 = lo * CONVERT_CHUNK, i1 = hi * CONVERT_CHUNK < a->n ? hi * CONVERT_CHUNK : a->n;
  a->fn(a->y + (size_t)i0 * a->ysz, a->x + (size_t)i0 * a->xsz, i1 - i0);
}

tp_status_t tp_cpu_convert(tp_stream_t s, void *y, tp_dtype_t ydt, const void *x, tp_dtype_t xdt, int64_t n) {
  (void)s;
  size_t ysz = tp_dtype_size(ydt), xsz = tp_dtype_size(xdt), nbytes;
  if (n <= 0) return TP_SUCCESS;
  if (ydt == xdt && (ydt == TP_FLOAT32 || lp_dtype(ydt))) {
    if (!tp_mul_size((size_t)n, ysz, &nbytes))
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "convert: %lld elements overflow the address space", (long long)n);
    memcpy(y, x, nbytes);
    return TP_SUCCESS;
  }
  convert_args a = {convert_for(ydt, xdt), y, x, ysz, xsz, n};
  if (!a.fn)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "convert: no conversion from %s to %s (float32, bfloat16, float16)",
                        tp_dtype_name(xdt), tp_dtype_name(ydt));
  /* memory-bound: threads pay off only on large arrays (parallel.h's per-thread minimum) */
  tp_parallel_rows((n + CONVERT_CHUNK - 1) / CONVERT_CHUNK, CONVERT_CHUNK, convert_chunk, &a);
  return TP_SUCCESS;
}

typedef struct {
  float *panel;
  const char *w;
  tp_dtype_t wdt;
  size_t rb;
  int64_t K;
} dequant_args;

static void dequant_chunk(void *ctx, int64_t r0, int64_t r1, int chunk) {
  (void)chunk;
  const dequant_args *a = ctx;
  for (int64_t r = r0; r < r1; r++) tp_q_dequant_row(a->wdt, a->panel + r * a->K, a->w + (size_t)r * a->rb, a->K);
}

/* rows x K of w (rows of row_bytes each) widened into a float32 panel on this rank's threads
 * (BLAS's own threads are idle meanwhile). */
static void widen_panel(float *panel, const void *w, tp_dtype_t wdt, int64_t rows, int64_t K) {
  if (tp_q_format(wdt)) {
    dequant_args d = {panel, w, wdt, row_bytes(wdt, K), K};
    tp_parallel_rows(rows, K, dequant_chunk, &d);
    return;
  }
  int64_t n = rows * K;
  convert_args a = {
      wdt == TP_BFLOAT16 ? (convert_fn)cvt_f32_bf16 : (convert_fn)cvt_f32_f16, (char *)panel, (const char *)w, 4, 2, n};
  tp_parallel_rows((n + CONVERT_CHUNK - 1) / CONVERT_CHUNK, CONVERT_CHUNK, convert_chunk, &a);
}

/* ------------------------------------------------------------------ GEMV: w read once */

/* out[j] = sum_k x_j[k] w[k] for j < 4 (x_j may repeat: callers with fewer rows pass the
 * last row again and ignore its results).  The accumulation order is fixed per K, so a
 * result does not depend on the thread split. */
typedef void (*dot4_fn)(float out[4], const void *w, const float *const x[4], int64_t K);

static void dot4_portable(float out[4], const void *w, const float *const x[4], int64_t K, tp_dtype_t wdt) {
  float buf[256], acc[4] = {0, 0, 0, 0};
  for (int64_t k0 = 0; k0 < K; k0 += 256) {
    int64_t nk = K - k0 < 256 ? K - k0 : 256;
    widen(buf, (const uint16_t *)w + k0, wdt, nk);
    for (int j = 0; j < 4; j++) {
      const float *xj = x[j] + k0;
      float s = 0;
      for (int64_t k = 0; k < nk; k++) s += xj[k] * buf[k];
      acc[j] += s;
    }
  }
  memcpy(out, acc, sizeof acc);
}

static void dot4_portable_bf16(float out[4], const void *w, const float *const x[4], int64_t K) {
  dot4_portable(out, w, x, K, TP_BFLOAT16);
}

static void dot4_portable_f16(float out[4], const void *w, const float *const x[4], int64_t K) {
  dot4_portable(out, w, x, K, TP_FLOAT16);
}

/* out = sum_k x[k] w[k]: the M = 1 (decode) case without dot4's repeated rows. */
typedef float (*dot1_fn)(const void *w, const float *x, int64_t K);

static float dot1_portable_bf16(const void *w, const float *x, int64_t K) {
  float out[4];
  const float *xs[4] = {x, x, x, x};
  dot4_portable(out, w, xs, K, TP_BFLOAT16);
  return out[0];
}

static float dot1_portable_f16(const void *w, const float *x, int64_t K) {
  float out[4];
  const float *xs[4] = {x, x, x, x};
  dot4_portable(out, w, xs, K, TP_FLOAT16);
  return out[0];
}

#if TP_LOWP_X86
/* Four weight vectors per step into four accumulators (the FMA latency hidden). */
#define TP_DOT1_(NAME, TARGET, VEC, LANES, LOADW, FMA, ZERO, LOADX, HSUM, SCALAR)                \
  __attribute__((target(TARGET))) static float NAME(const void *wv, const float *x, int64_t K) { \
    const uint16_t *w = wv;                                                                      \
    VEC a0 = ZERO, a1 = ZERO, a2 = ZERO, a3 = ZERO;                                              \
    int64_t k = 0;                                                                               \
    for (; k + 4 * LANES <= K; k += 4 * LANES) {                                                 \
      a0 = FMA(LOADW(w + k), LOADX(x + k), a0);                                                  \
      a1 = FMA(LOADW(w + k + LANES), LOADX(x + k + LANES), a1);                                  \
      a2 = FMA(LOADW(w + k + 2 * LANES), LOADX(x + k + 2 * LANES), a2);                          \
      a3 = FMA(LOADW(w + k + 3 * LANES), LOADX(x + k + 3 * LANES), a3);                          \
    }                                                                                            \
    for (; k + LANES <= K; k += LANES) a0 = FMA(LOADW(w + k), LOADX(x + k), a0);                 \
    float s = HSUM((a0 + a1) + (a2 + a3));                                                       \
    for (; k < K; k++) s += x[k] * u2f(SCALAR(w[k]));                                            \
    return s;                                                                                    \
  }
#endif

#if TP_LOWP_X86
/* Two weight vectors per step, each fused into four rows' accumulators: eight independent
 * FMA chains hide the FMA latency; the tail widens one element at a time. */
#define TP_DOT4_(NAME, TARGET, VEC, LANES, LOADW, FMA, ZERO, LOADX, HSUM, SCALAR)                                      \
  __attribute__((target(TARGET))) static void NAME(float out[4], const void *wv, const float *const x[4], int64_t K) { \
    const uint16_t *w = wv;                                                                                            \
    VEC a0 = ZERO, a1 = ZERO, a2 = ZERO, a3 = ZERO, b0 = ZERO, b1 = ZERO, b2 = ZERO, b3 = ZERO;                        \
    int64_t k = 0;                                                                                                     \
    for (; k + 2 * LANES <= K; k += 2 * LANES) {                                                                       \
      VEC w0 = LOADW(w + k), w1 = LOADW(w + k + LANES);                                                                \
      a0 = FMA(w0, LOADX(x[0] + k), a0), b0 = FMA(w1, LOADX(x[0] + k + LANES), b0);                                    \
      a1 = FMA(w0, LOADX(x[1] + k), a1), b1 = FMA(w1, LOADX(x[1] + k + LANES), b1);                                    \
      a2 = FMA(w0, LOADX(x[2] + k), a2), b2 = FMA(w1, LOADX(x[2] + k + LANES), b2);                                    \
      a3 = FMA(w0, LOADX(x[3] + k), a3), b3 = FMA(w1, LOADX(x[3] + k + LANES), b3);                                    \
    }                                                                                                                  \
    for (; k + LANES <= K; k += LANES) {                                                                               \
      VEC w0 = LOADW(w + k);                                                                                           \
      a0 = FMA(w0, LOADX(x[0] + k), a0), a1 = FMA(w0, LOADX(x[1] + k), a1);                                            \
      a2 = FMA(w0, LOADX(x[2] + k), a2), a3 = FMA(w0, LOADX(x[3] + k), a3);                                            \
    }                                                                                                                  \
    float s[4] = {HSUM(a0 + b0), HSUM(a1 + b1), HSUM(a2 + b2), HSUM(a3 + b3)};                                         \
    for (; k < K; k++) {                                                                                               \
      float wk = u2f(SCALAR(w[k]));                                                                                    \
      for (int j = 0; j < 4; j++) s[j] += x[j][k] * wk;                                                                \
    }                                                                                                                  \
    memcpy(out, s, sizeof s);                                                                                          \
  }

#define LOADW512_BF16(p) \
  _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define LOADW512_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define LOADW256_BF16(p) \
  _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define LOADW256_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))

__attribute__((target("avx2,fma"))) static inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

TP_DOT4_(dot4_avx512_bf16, "avx512f", __m512, 16, LOADW512_BF16, _mm512_fmadd_ps, _mm512_setzero_ps(), _mm512_loadu_ps,
         _mm512_reduce_add_ps, bf16_to_f32)
TP_DOT4_(dot4_avx512_f16, "avx512f", __m512, 16, LOADW512_F16, _mm512_fmadd_ps, _mm512_setzero_ps(), _mm512_loadu_ps,
         _mm512_reduce_add_ps, f16_to_f32)
TP_DOT4_(dot4_avx2_bf16, "avx2,fma,f16c", __m256, 8, LOADW256_BF16, _mm256_fmadd_ps, _mm256_setzero_ps(),
         _mm256_loadu_ps, hsum256, bf16_to_f32)
TP_DOT4_(dot4_avx2_f16, "avx2,fma,f16c", __m256, 8, LOADW256_F16, _mm256_fmadd_ps, _mm256_setzero_ps(), _mm256_loadu_ps,
         hsum256, f16_to_f32)
#undef TP_DOT4_
TP_DOT1_(dot1_avx512_bf16, "avx512f", __m512, 16, LOADW512_BF16, _mm512_fmadd_ps, _mm512_setzero_ps(), _mm512_loadu_ps,
         _mm512_reduce_add_ps, bf16_to_f32)
TP_DOT1_(dot1_avx512_f16, "avx512f", __m512, 16, LOADW512_F16, _mm512_fmadd_ps, _mm512_setzero_ps(), _mm512_loadu_ps,
         _mm512_reduce_add_ps, f16_to_f32)
TP_DOT1_(dot1_avx2_bf16, "avx2,fma,f16c", __m256, 8, LOADW256_BF16, _mm256_fmadd_ps, _mm256_setzero_ps(),
         _mm256_loadu_ps, hsum256, bf16_to_f32)
TP_DOT1_(dot1_avx2_f16, "avx2,fma,f16c", __m256, 8, LOADW256_F16, _mm256_fmadd_ps, _mm256_setzero_ps(), _mm256_loadu_ps,
         hsum256, f16_to_f32)
#undef TP_DOT1_
#endif

/* The widest kernels this CPU runs (checked once; a racing first call picks the same ones). */
static int gemv_isa(void) {
#if TP_LOWP_X86
  static int isa = -1; /* 2: AVX-512F, 1: AVX2 + FMA + F16C, 0: portable */
  if (isa < 0) {
    __builtin_cpu_init();
    isa = __builtin_cpu_supports("avx512f")                                                                   ? 2
          : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") ? 1
                                                                                                              : 0;
  }
#ifdef TP_LOWP_MAX_ISA /* a build that tests the narrower kernels on a wider CPU: -DTP_LOWP_MAX_ISA=1 or 0 */
  if (isa > TP_LOWP_MAX_ISA) isa = TP_LOWP_MAX_ISA;
#endif
  return isa;
#else
  return 0;
#endif
}

static dot4_fn dot4_for(tp_dtype_t wdt) {
  if (tp_q_format(wdt)) return tp_q_dot4_for(wdt);
  int bf = wdt == TP_BFLOAT16, isa = gemv_isa();
#if TP_LOWP_X86
  if (isa == 2) return bf ? dot4_avx512_bf16 : dot4_avx512_f16;
  if (isa == 1) return bf ? dot4_avx2_bf16 : dot4_avx2_f16;
#endif
  (void)isa;
  return bf ? dot4_portable_bf16 : dot4_portable_f16;
}

static dot1_fn dot1_for(tp_dtype_t wdt) {
  if (tp_q_format(wdt)) return tp_q_dot1_for(wdt);
  int bf = wdt == TP_BFLOAT16, isa = gemv_isa();
#if TP_LOWP_X86
  if (isa == 2) return bf ? dot1_avx512_bf16 : dot1_avx512_f16;
  if (isa == 1) return bf ? dot1_avx2_bf16 : dot1_avx2_f16;
#endif
  (void)isa;
  return bf ? dot1_portable_bf16 : dot1_portable_f16;
}

typedef struct {
  dot1_fn dot1;
  dot4_fn dot;
  float *y;
  const float *x, *b;
  const char *w;
  size_t rb; /* bytes of a weight row */
  int64_t M, K, N;
} gemv_args;

/* Output columns [n0, n1) for every row of x, four rows per pass over a weight row (which
 * stays in L1/L2 for the next four: w comes from memory once). */
static void gemv_chunk(void *ctx, int64_t n0, int64_t n1, int chunk) {
  (void)chunk;
  const gemv_args *a = ctx;
  int64_t M = a->M, K = a->K, N = a->N;
  if (M == 1) {
    for (int64_t n = n0; n < n1; n++) a->y[n] = a->dot1(a->w + (size_t)n * a->rb, a->x, K) + (a->b ? a->b[n] : 0.0f);
    return;
  }
  for (int64_t n = n0; n < n1; n++) {
    float bn = a->b ? a->b[n] : 0.0f;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      int64_t mb = M - m0 < 4 ? M - m0 : 4;
      const float *xs[4];
      for (int j = 0; j < 4; j++) xs[j] = a->x + (m0 + (j < mb ? j : mb - 1)) * K;
      float out[4];
      a->dot(out, a->w + (size_t)n * a->rb, xs, K);
      for (int64_t j = 0; j < mb; j++) a->y[(m0 + j) * N + n] = out[j] + bn;
    }
  }
}

/* ------------------------------------------------------------------ linear */

/* Rows of w one panel holds: PANEL_BYTES of float32, at least PANEL_MIN_ROWS, at most N. */
static int64_t panel_rows(int64_t K, int64_t N) {
  int64_t rows = K > 0 ? PANEL_BYTES / (4 * K) : N;
  if (rows < PANEL_MIN_ROWS) rows = PANEL_MIN_ROWS;
  return rows < N ? rows : N;
}

/* Forward wants no workspace on the GEMV path (M <= GEMV_MAX_M); otherwise (and for
 * backward's dx) one panel.  Any workspace of at least K float32 (one row) is accepted:
 * the panel is then as many rows as fit; with less than one row the entries fall back to
 * the GEMV (forward) or a widening loop (backward), slower but correct. */
size_t tp_cpu_linear_lp_workspace(int64_t M, int64_t K, int64_t N, tp_dtype_t wdt, int backward) {
  (void)wdt;
  if (M <= 0 || K <= 0 || N <= 0 || (!backward && M <= GEMV_MAX_M)) return 0;
  size_t nbytes;
  if (!tp_mul_size((size_t)panel_rows(K, N), (size_t)K * 4, &nbytes)) return 0; /* K <= INT_MAX: cannot overflow */
  return nbytes;
}

/* A quantized wdt's K must be whole blocks, and its weight has no gradient. */
static tp_status_t check_quant(const char *op, tp_dtype_t wdt, int64_t K, const float *dw) {
  if (!tp_q_format(wdt)) return TP_SUCCESS;
  size_t rb;
  if (!tp_weight_row_bytes(wdt, K, &rb))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: K = %lld is not whole blocks of %s", op, (long long)K,
                        tp_dtype_name(wdt));
  if (dw)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: dw must be NULL for %s weights (quantized weights are frozen)",
                        op, tp_dtype_name(wdt));
  return TP_SUCCESS;
}

tp_status_t tp_cpu_linear_forward_lp(tp_stream_t s, float *y, const float *x, const void *w, tp_dtype_t wdt,
                                     const float *b, int64_t M, int64_t K, int64_t N, void *workspace,
                                     size_t workspace_bytes) {
  (void)s;
  TP_CHECK(check_quant("linear_forward_lp", wdt, K, NULL));
  if (M == 0 || N == 0) return TP_SUCCESS;
  if (K == 0) {
    for (int64_t m = 0; m < M; m++) {
      if (b) memcpy(y + m * N, b, (size_t)N * sizeof(float));
      else memset(y + m * N, 0, (size_t)N * sizeof(float));
    }
    return TP_SUCCESS;
  }
  int64_t rows = workspace ? (int64_t)(workspace_bytes / ((size_t)K * 4)) : 0;
  if (rows > N) rows = N;
  if (M <= GEMV_MAX_M || rows < 1) {
    gemv_args a = {dot1_for(wdt), dot4_for(wdt), y, x, b, w, row_bytes(wdt, K), M, K, N};
    int64_t per_row;
    if (!tp_mul_count(M < 4 ? 4 : M, K, &per_row)) per_row = INT64_MAX;
    tp_parallel_rows(N, per_row, gemv_chunk, &a);
    return TP_SUCCESS;
  }
  float beta = 0.0f;
  if (b) {
    for (int64_t m = 0; m < M; m++) memcpy(y + m * N, b, (size_t)N * sizeof(float));
    beta = 1.0f;
  }
  float *panel = workspace;
  for (int64_t n0 = 0; n0 < N; n0 += rows) {
    int64_t nr = N - n0 < rows ? N - n0 : rows;
    widen_panel(panel, (const char *)w + (size_t)n0 * row_bytes(wdt, K), wdt, nr, K);
    TP_BLAS(cblas_sgemm)(CblasRowMajor, CblasNoTrans, CblasTrans, (tp_blasint)M, (tp_blasint)nr, (tp_blasint)K, 1.0f, x,
                         (tp_blasint)K, panel, (tp_blasint)K, beta, y + n0, (tp_blasint)N);
  }
  return TP_SUCCESS;
}

/* dx[M,K] (+)= dy[M,N] w[N,K] without a panel: each widened weight row scaled into dx. */
TP_VECTOR_CLONES static void dx_axpy_rows(float *dx, const float *dy, const void *w, tp_dtype_t wdt, int64_t M,
                                          int64_t K, int64_t N, int accumulate) {
  float buf[256]; /* a multiple of every block (32, 256) */
  size_t rb = row_bytes(wdt, K);
  for (int64_t k0 = 0; k0 < K; k0 += 256) {
    int64_t nk = K - k0 < 256 ? K - k0 : 256;
    for (int64_t m = 0; m < M; m++)
      if (!accumulate) memset(dx + m * K + k0, 0, (size_t)nk * sizeof(float));
    for (int64_t n = 0; n < N; n++) {
      widen_span(buf, (const char *)w + (size_t)n * rb, wdt, k0, nk, K);
      for (int64_t m = 0; m < M; m++) {
        float d = dy[m * N + n], *row = dx + m * K + k0;
        for (int64_t k = 0; k < nk; k++) row[k] += d * buf[k];
      }
    }
  }
}

tp_status_t tp_cpu_linear_backward_lp(tp_stream_t s, float *dx, float *dw, float *db, const float *dy, const float *x,
                                      const void *w, tp_dtype_t wdt, int64_t M, int64_t K, int64_t N, int accumulate_dx,
                                      void *workspace, size_t workspace_bytes) {
  TP_CHECK(check_quant("linear_backward_lp", wdt, K, dw));
  /* dw and db never read w: the float32 entry's sgemm and column sums */
  tp_status_t st = tp_cpu_linear_backward(s, NULL, dw, db, dy, x, NULL, M, K, N, 0);
  if (st != TP_SUCCESS || !dx || M == 0 || K == 0) return st;
  if (N == 0) {
    if (!accumulate_dx) memset(dx, 0, (size_t)(M * K) * sizeof(float));
    return TP_SUCCESS;
  }
  int64_t rows = workspace ? (int64_t)(workspace_bytes / ((size_t)K * 4)) : 0;
  if (rows > N) rows = N;
  if (rows < 1) {
    dx_axpy_rows(dx, dy, w, wdt, M, K, N, accumulate_dx);
    return TP_SUCCESS;
  }
  float *panel = workspace;
  for (int64_t n0 = 0; n0 < N; n0 += rows) {
    int64_t nr = N - n0 < rows ? N - n0 : rows;
    widen_panel(panel, (const char *)w + (size_t)n0 * row_bytes(wdt, K), wdt, nr, K);
    float beta = n0 == 0 && !accumulate_dx ? 0.0f : 1.0f;
    TP_BLAS(cblas_sgemm)(CblasRowMajor, CblasNoTrans, CblasNoTrans, (tp_blasint)M, (tp_blasint)K, (tp_blasint)nr, 1.0f,
                         dy + n0, (tp_blasint)N, panel, (tp_blasint)K, beta, dx, (tp_blasint)K);
  }
  return TP_SUCCESS;
}

/* ------------------------------------------------------------------ embedding */

tp_status_t tp_cpu_embedding_forward_lp(tp_stream_t s, float *out, const int64_t *tokens, const void *table,
                                        tp_dtype_t wdt, int64_t M, int64_t lo, int64_t V, int64_t C) {
  (void)s;
  TP_CHECK(check_quant("embedding_forward_lp", wdt, C, NULL));
  for (int64_t m = 0; m < M; m++) {
    uint64_t t = (uint64_t)tokens[m] - (uint64_t)lo; /* in [0, V) iff the token is in the shard */
    if (t < (uint64_t)V) widen_span(out + m * C, (const char *)table + t * row_bytes(wdt, C), wdt, 0, C, C);
    else memset(out + m * C, 0, (size_t)C * sizeof(float));
  }
  return TP_SUCCESS;
}
