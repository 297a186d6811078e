/* The block-quantized weight rows of cpu/quant.c (quant_impl.h): the dequantizers against a
 * decoder written here from the layouts (double precision, ldexp for the f16 fields), the
 * dot1 / dot4 kernels of every ISA level this CPU runs against a double dot of the
 * dequantized row, quantize -> dequantize error bounds, and blocks whose f16 fields are
 * Inf / NaN (no crash; the poisoned block's values are non-finite, the others unchanged).
 * Bit-for-bit equality with gguf-py's dequantizers is tests/csrc/test_quant_kernels.py's.
 *
 * Fresh random rows each run: the seed is printed (TP_QUANT_SEED=N repeats a run). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <stdarg.h>
#include <time.h>
#include <unistd.h>

#include "test_kernels.h"
#include "../kernels/cpu/quant_impl.h"

static int qbad;
static uint64_t qrng;
static void *qpool[1024];
static int nq;

/* Zeroed memory, freed by qrelease() after each check. */
static void *qmem(size_t nbytes) {
  void *p = calloc(1, nbytes ? nbytes : 1);
  if (!p || nq == 1024) {
    printf("out of host memory in the quant checks\n");
    exit(2);
  }
  return qpool[nq++] = p;
}

static void qrelease(void) {
  while (nq) free(qpool[--nq]);
}

static void qfail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void qfail(const char *fmt, ...) {
  if (qbad++ > 20) return; /* the first failures say enough */
  va_list ap;
  va_start(ap, fmt);
  printf("    ");
  vprintf(fmt, ap);
  printf("\n");
  va_end(ap);
}

static uint64_t q_u64(void) { /* splitmix64 */
  uint64_t z = (qrng += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

static double q_unif(void) { return (double)(q_u64() >> 11) / 9007199254740992.0; } /* [0, 1) */

static double q_gauss(void) { /* Box-Muller */
  double u = q_unif(), v = q_unif();
  return sqrt(-2 * log(1 - u)) * cos(6.283185307179586 * v);
}

/* An f16 field's value, from the definition. */
static double half_value(const uint8_t *p) {
  unsigned h = p[0] | p[1] << 8, e = (h >> 10) & 31, m = h & 1023;
  double v = e == 31 ? (m ? NAN : INFINITY) : e == 0 ? ldexp(m, -24) : ldexp(m | 1024, (int)e - 25);
  return (h >> 15) ? -v : v;
}

/* A finite f16 of about `scale` in magnitude, random sign and mantissa (subnormals now and then). */
static void put_half(uint8_t *p, double scale) {
  double v = scale * (0.25 + q_unif()) * (q_u64() & 1 ? -1 : 1);
  if ((q_u64() & 15) == 0) v = ldexp((double)(q_u64() % 1024), -24); /* subnormal */
  int e;
  double f = frexp(fabs(v), &e); /* v = f 2^e, f in [0.5, 1) */
  unsigned h;
  if (e - 1 < -14) h = (unsigned)(fabs(v) * 16777216.0); /* subnormal: m 2^-24, truncated */
  else h = (unsigned)(e - 1 + 15) << 10 | ((unsigned)(f * 2048) & 1023);
  h |= v < 0 ? 0x8000u : 0;
  p[0] = (uint8_t)h, p[1] = (uint8_t)(h >> 8);
}

typedef struct {
  tp_dtype_t f;
  const char *name;
  int blk, bb;
} qfmt;

static const qfmt FMTS[] = {{TP_INT8, "int8", 1, 1},    {TP_Q8_0, "q8_0", 32, 34},   {TP_Q4_0, "q4_0", 32, 18},
                            {TP_Q4_1, "q4_1", 32, 20},  {TP_Q4_K, "q4_k", 256, 144}, {TP_Q5_K, "q5_k", 256, 176},
                            {TP_Q6_K, "q6_k", 256, 210}};

static size_t row_bytes(const qfmt *q, int64_t K) {
  return q->f == TP_INT8 ? 4 + (size_t)K : (size_t)(K / q->blk) * q->bb;
}

/* Random bytes with finite f16 fields of random magnitude (an int8 row: a random float32 scale). */
static void random_row(const qfmt *q, uint8_t *r, int64_t K) {
  size_t n = row_bytes(q, K);
  for (size_t i = 0; i < n; i++) r[i] = (uint8_t)q_u64();
  double mag = ldexp(1.0, (int)(q_u64() % 16) - 12); /* 2^-12 .. 2^3 */
  if (q->f == TP_INT8) {
    float s = (float)(mag * q_unif());
    memcpy(r, &s, 4);
    return;
  }
  for (int64_t b = 0; b < K / q->blk; b++) {
    uint8_t *p = r + b * q->bb;
    switch (q->f) {
      case TP_Q6_K: put_half(p + 208, mag); break;
      case TP_Q4_1:
      case TP_Q4_K:
      case TP_Q5_K: put_half(p, mag), put_half(p + 2, mag); break;
      default: put_half(p, mag);
    }
  }
}

/* The reference value of element k, and `mag` = the sum of the magnitudes of its terms. */
static double ref_value(const qfmt *q, const uint8_t *r, int64_t k, double *mag) {
  if (q->f == TP_INT8) {
    float s;
    memcpy(&s, r, 4);
    double v = (double)s * (int8_t)r[4 + k];
    *mag = fabs(v);
    return v;
  }
  const uint8_t *b = r + (k / q->blk) * q->bb;
  int j = (int)(k % q->blk);
  double d, m = 0, qv;
  switch (q->f) {
    case TP_Q8_0: d = half_value(b), qv = (int8_t)b[2 + j]; break;
    case TP_Q4_0: d = half_value(b), qv = (j < 16 ? (b[2 + j] & 15) : (b[2 + j - 16] >> 4)) - 8; break;
    case TP_Q4_1:
      d = half_value(b), m = half_value(b + 2);
      qv = j < 16 ? (b[4 + j] & 15) : (b[4 + j - 16] >> 4);
      break;
    case TP_Q4_K:
    case TP_Q5_K: {
      int s = j / 32, l = j % 32, sc, mn;
      const uint8_t *S = b + 4;
      if (s < 4) sc = S[s] & 63, mn = S[s + 4] & 63;
      else sc = (S[s + 4] & 15) | (S[s - 4] >> 6) << 4, mn = (S[s + 4] >> 4) | (S[s] >> 6) << 4;
      const uint8_t *qs = b + (q->f == TP_Q4_K ? 16 : 48);
      int nib = (s % 2) ? qs[32 * (s / 2) + l] >> 4 : qs[32 * (s / 2) + l] & 15;
      if (q->f == TP_Q5_K) nib |= ((b[16 + l] >> s) & 1) << 4;
      d = half_value(b) * sc, m = -half_value(b + 2) * mn, qv = nib;
      break;
    }
    default: { /* Q6_K */
      int h = j / 128, i = (j % 128) / 32, l = j % 32;
      int lo = b[64 * h + 32 * (i % 2) + l];
      int v = ((i / 2) ? lo >> 4 : lo & 15) | ((b[128 + 32 * h + l] >> (2 * i)) & 3) << 4;
      d = half_value(b + 208) * (int8_t)b[192 + j / 16], qv = v - 32;
    }
  }
  *mag = fabs(d * qv) + fabs(m);
  return d * qv + m;
}

/* The sizes of a case: one block, several, odd block counts (int8 rows: any K). */
static int64_t case_k(const qfmt *q, int c) {
  static const int64_t nblk[] = {1, 2, 3, 5, 17, 6};
  static const int64_t kint8[] = {1, 7, 64, 100, 577, 1536};
  return q->f == TP_INT8 ? kint8[c] : nblk[c] * q->blk;
}

static void check_dequant_and_dots(const qfmt *q) {
  static const char *isa_name[] = {"portable", "avx2", "avx512"};
  for (int c = 0; c < 6; c++) {
    int64_t K = case_k(q, c);
    size_t rb = row_bytes(q, K), want;
    if (!tp_weight_row_bytes(q->f, K, &want) || want != rb)
      qfail("%s: tp_weight_row_bytes(K=%lld)", q->name, (long long)K);
    for (int rep = 0; rep < 3; rep++) {
      uint8_t *r = qmem(rb);
      float *y = qmem((size_t)K * sizeof(float));
      double *mag = qmem((size_t)K * sizeof(double)), *ref = qmem((size_t)K * sizeof(double));
      random_row(q, r, K);
      tp_q_dequant_row(q->f, y, r, K);
      for (int64_t k = 0; k < K; k++) {
        ref[k] = ref_value(q, r, k, &mag[k]);
        if (!(fabs(y[k] - ref[k]) <= 4 * U * mag[k] + 1e-300 || y[k] == ref[k])) {
          qfail("%s K=%lld: dequant[%lld] = %.9g, reference %.9g", q->name, (long long)K, (long long)k, y[k], ref[k]);
          break;
        }
      }
      /* x: four rows of uniform and Gaussian values; mag of the dot: sum |x| (|d q| + |m|) */
      float *x[4];
      double dref[4], dmag[4];
      for (int j = 0; j < 4; j++) {
        x[j] = qmem((size_t)K * sizeof(float));
        dref[j] = dmag[j] = 0;
        for (int64_t k = 0; k < K; k++) {
          x[j][k] = (float)(j & 1 ? q_gauss() : 2 * q_unif() - 1);
          dref[j] += (double)x[j][k] * y[k], dmag[j] += fabs(x[j][k]) * mag[k];
        }
      }
      for (int isa = 0; isa <= tp_q_cpu_isa(); isa++) {
        float *yi = qmem((size_t)K * sizeof(float));
        if (!tp_q_dequant_row_at(q->f, yi, r, K, isa) || memcmp(yi, y, (size_t)K * sizeof(float)))
          qfail("%s %s K=%lld: dequant differs from the dispatched one", q->name, isa_name[isa], (long long)K);
        tp_q_dot1_fn d1 = tp_q_dot1_at(q->f, isa);
        tp_q_dot4_fn d4 = tp_q_dot4_at(q->f, isa);
        if (!d1 || !d4) {
          qfail("%s: no kernel at %s", q->name, isa_name[isa]);
          continue;
        }
        for (int j = 0; j < 4; j++) {
          float got = d1(r, x[j], K);
          if (!(fabs(got - dref[j]) <= 1e-5 * dmag[j] + 1e-30))
            qfail("%s %s K=%lld: dot1 = %.9g, reference %.9g (tol %.3g)", q->name, isa_name[isa], (long long)K, got,
                  dref[j], 1e-5 * dmag[j]);
        }
        float out[4];
        const float *xs[4] = {x[0], x[1], x[2], x[3]};
        d4(out, r, xs, K);
        for (int j = 0; j < 4; j++)
          if (!(fabs(out[j] - dref[j]) <= 1e-5 * dmag[j] + 1e-30))
            qfail("%s %s K=%lld: dot4[%d] = %.9g, reference %.9g", q->name, isa_name[isa], (long long)K, j, out[j],
                  dref[j]);
        const float *rep3[4] = {x[1], x[3], x[3], x[3]}; /* a caller with two rows repeats the last */
        d4(out, r, rep3, K);
        if (!(fabs(out[0] - dref[1]) <= 1e-5 * dmag[1] + 1e-30) || !(fabs(out[3] - dref[3]) <= 1e-5 * dmag[3] + 1e-30))
          qfail("%s %s K=%lld: dot4 with repeated rows", q->name, isa_name[isa], (long long)K);
      }
    }
  }
}

/* Gaussian rows quantized and dequantized: elementwise bounds where the step is known
 * (llama.cpp's reference quantizers, int8 rows), the relative RMS error for the K-quants. */
static void check_roundtrip(const qfmt *q) {
  for (int c = 0; c < 6; c++) {
    int64_t K = case_k(q, c);
    size_t rb = row_bytes(q, K);
    float *x = qmem((size_t)K * sizeof(float)), *y = qmem((size_t)K * sizeof(float));
    uint8_t *r = qmem(rb);
    /* sigma from 2^-12 (f16 subnormal d) to 2^3; from 2^-8 for the K-quants, whose 6-bit
     * sub-block scales of an f16 subnormal d are coarse (as in llama.cpp) */
    int kquant = q->f == TP_Q4_K || q->f == TP_Q5_K || q->f == TP_Q6_K;
    double sigma = ldexp(1.0, (int)(q_u64() % (kquant ? 12 : 16)) - (kquant ? 8 : 12)), e2 = 0, x2 = 0;
    for (int64_t k = 0; k < K; k++) x[k] = (float)(sigma * q_gauss());
    if (c == 2) x[K / 2] = (float)(40 * sigma); /* an outlier */
    tp_q_quant_row(q->f, r, x, K);
    tp_q_dequant_row(q->f, y, r, K);
    int blk = q->f == TP_INT8 ? (int)K : q->blk;
    for (int64_t b0 = 0; b0 < K; b0 += blk) {
      double amax = 0, lo = INFINITY, hi = -INFINITY;
      for (int64_t k = b0; k < b0 + blk; k++) amax = fmax(amax, fabs(x[k])), lo = fmin(lo, x[k]), hi = fmax(hi, x[k]);
      /* per element: half a step (Q4_0: a whole one, its +8 side clips at 15), plus the f16
       * rounding of the stored d (times the largest code) and m: half an f16 ulp, 2^-11
       * relative or 2^-25 (the subnormals' half spacing), whichever is larger; 1e-6 amax for the
       * float rounding of x / d */
#define H16(v) fmax(fabs(v) / 2048, 0x1p-25)
      double bound;
      switch (q->f) {
        case TP_INT8: bound = 0.5 * amax / 127 * (1 + 1e-6) + 4 * U * amax; break;
        case TP_Q8_0: bound = 0.5 * amax / 127 + 127 * H16(amax / 127) + 1e-6 * amax; break;
        case TP_Q4_0: bound = amax / 8 + 8 * H16(amax / 8) + 1e-6 * amax; break;
        case TP_Q4_1: bound = 0.5 * (hi - lo) / 15 + 15 * H16((hi - lo) / 15) + H16(lo) + 1e-6 * amax; break;
        default: bound = INFINITY; /* the K-quants: RMS below */
      }
#undef H16
      for (int64_t k = b0; k < b0 + blk; k++) {
        double e = fabs((double)y[k] - x[k]);
        e2 += e * e, x2 += (double)x[k] * x[k];
        if (!(e <= bound)) {
          qfail("%s K=%lld: x[%lld] = %.9g comes back as %.9g (bound %.3g)", q->name, (long long)K, (long long)k, x[k],
                y[k], bound);
          return;
        }
      }
    }
    /* relative RMS error of the K-quants on Gaussian rows, typical (worst of 200 rows of one
     * super-block) measured: q4_k 0.070 (0.082), q5_k 0.035 (0.041), q6_k 0.017 (0.020);
     * llama.cpp's reference quantizers 0.071 (0.083), 0.036 (0.044), 0.018 (0.020).  With a
     * 40-sigma outlier the super-block's scales coarsen (worst of 200: 0.120, 0.057, 0.042;
     * llama.cpp 0.120, 0.060, 0.042). */
    int kq = q->f == TP_Q4_K ? 0 : q->f == TP_Q5_K ? 1 : q->f == TP_Q6_K ? 2 : -1;
    static const double limits[2][3] = {{0.09, 0.046, 0.022}, {0.14, 0.068, 0.05}};
    double limit = kq < 0 ? INFINITY : limits[c == 2][kq];
    if (!(sqrt(e2 / x2) <= limit))
      qfail("%s K=%lld: relative RMS error %.4f > %.3f", q->name, (long long)K, sqrt(e2 / x2), limit);
  }
  /* zeros come back as zeros; a constant row within a step */
  int64_t K = case_k(q, 2);
  float *x = qmem((size_t)K * sizeof(float)), *y = qmem((size_t)K * sizeof(float));
  uint8_t *r = qmem(row_bytes(q, K));
  tp_q_quant_row(q->f, r, x, K);
  tp_q_dequant_row(q->f, y, r, K);
  for (int64_t k = 0; k < K; k++)
    if (y[k] != 0) {
      qfail("%s: a zero row comes back with %.9g at %lld", q->name, y[k], (long long)k);
      break;
    }
  for (int64_t k = 0; k < K; k++) x[k] = -0.7f;
  tp_q_quant_row(q->f, r, x, K);
  tp_q_dequant_row(q->f, y, r, K);
  for (int64_t k = 0; k < K; k++)
    if (!(fabs(y[k] + 0.7) <= 0.7 / 100)) {
      qfail("%s: a constant row -0.7 comes back with %.9g at %lld", q->name, y[k], (long long)k);
      break;
    }
}

/* Inf / NaN in a block's f16 fields (int8: the row's scale): no crash at any ISA, the
 * poisoned block's values non-finite, the other blocks' unchanged, the dots non-finite. */
static void check_nonfinite(const qfmt *q) {
  static const uint16_t bad[] = {0x7c00, 0xfc00, 0x7e00, 0x7c01};
  int64_t K = case_k(q, 3);
  size_t rb = row_bytes(q, K);
  uint8_t *r = qmem(rb), *r2 = qmem(rb);
  float *y = qmem((size_t)K * sizeof(float)), *y2 = qmem((size_t)K * sizeof(float)),
        *x = qmem((size_t)K * sizeof(float));
  for (int64_t k = 0; k < K; k++) x[k] = (float)(0.5 + 0.5 * q_unif());
  for (int t = 0; t < 4; t++) {
    random_row(q, r, K);
    memcpy(r2, r, rb);
    int64_t nb = q->f == TP_INT8 ? 1 : K / q->blk, pb = (int64_t)(q_u64() % (uint64_t)nb);
    int blk = q->f == TP_INT8 ? (int)K : q->blk;
    uint8_t *p = r2 + pb * q->bb;
    int field = q->f == TP_Q6_K ? 208 : (q->f == TP_Q4_1 || q->f == TP_Q4_K || q->f == TP_Q5_K) ? 2 * (t & 1) : 0;
    if (q->f == TP_INT8) {
      uint32_t u = bad[t] & 0x8000 ? 0xff800000u : bad[t] == 0x7c00 ? 0x7f800000u : 0x7fc00001u;
      memcpy(r2, &u, 4);
    } else {
      p[field] = (uint8_t)bad[t], p[field + 1] = (uint8_t)(bad[t] >> 8);
    }
    for (int isa = 0; isa <= tp_q_cpu_isa(); isa++) {
      tp_q_dequant_row_at(q->f, y, r, K, isa);
      tp_q_dequant_row_at(q->f, y2, r2, K, isa);
      for (int64_t k = 0; k < K; k++) {
        int in_block = k / blk == pb;
        /* an Inf / NaN min poisons every element of its block; so does a scale (Inf * 0 is NaN) */
        if (in_block ? isfinite(y2[k]) : memcmp(&y[k], &y2[k], 4) != 0) {
          qfail("%s isa %d: f16 field %04x: element %lld = %.9g (clean %.9g)", q->name, isa, bad[t], (long long)k,
                y2[k], y[k]);
          break;
        }
      }
      float d1 = tp_q_dot1_at(q->f, isa)(r2, x, K), out[4];
      const float *xs[4] = {x, x, x, x};
      tp_q_dot4_at(q->f, isa)(out, r2, xs, K);
      if (isfinite(d1) || isfinite(out[0]) || isfinite(out[3]))
        qfail("%s isa %d: f16 field %04x: dot1 %.9g, dot4 %.9g (non-finite expected)", q->name, isa, bad[t], d1,
              out[0]);
    }
  }
}

static void check_dispatch(void) {
  for (size_t i = 0; i < sizeof FMTS / sizeof FMTS[0]; i++) {
    const qfmt *q = &FMTS[i];
    if (!tp_q_format(q->f) || !tp_q_dot1_for(q->f) || !tp_q_dot4_for(q->f)) qfail("%s: not a quant format", q->name);
#ifndef TP_LOWP_MAX_ISA
    if (tp_q_dot1_for(q->f) != tp_q_dot1_at(q->f, tp_q_cpu_isa()) ||
        tp_q_dot4_for(q->f) != tp_q_dot4_at(q->f, tp_q_cpu_isa()))
      qfail("%s: tp_q_dot*_for is not the widest level's kernel", q->name);
#endif
    if (tp_q_dot1_at(q->f, tp_q_cpu_isa() + 1) || tp_q_dot1_at(q->f, -1)) qfail("%s: a level past the CPU's", q->name);
  }
  static const tp_dtype_t others[] = {TP_FLOAT32, TP_FLOAT16, TP_BFLOAT16, TP_UINT8, TP_INT32, TP_WEIGHT_FORMAT_END};
  for (size_t i = 0; i < sizeof others / sizeof others[0]; i++)
    if (tp_q_format(others[i]) || tp_q_dot1_for(others[i]) || tp_q_dot4_at(others[i], 0))
      qfail("%s is taken for a quant format", tp_dtype_name(others[i]));
}

void run_quant_tests(int *passed, int *failed) {
  const char *env = getenv("TP_QUANT_SEED");
  uint64_t seed = env ? strtoull(env, NULL, 10) : (uint64_t)time(NULL) * 1000003u ^ (uint64_t)getpid();
  static const char *isa_name[] = {"portable", "AVX2", "AVX-512"};
  printf("quant: seed %llu (TP_QUANT_SEED), widest ISA %s\n", (unsigned long long)seed, isa_name[tp_q_cpu_isa()]);
  struct {
    const char *name;
    void (*fn)(const qfmt *);
  } t[] = {{"dequant + dot1/dot4", check_dequant_and_dots},
           {"quant round trip", check_roundtrip},
           {"Inf/NaN fields", check_nonfinite}};
  qbad = 0;
  qrng = seed;
  check_dispatch();
  printf("quant dispatch: %s\n", qbad ? "FAIL" : "ok");
  qbad ? (*failed)++ : (*passed)++;
  for (size_t i = 0; i < sizeof FMTS / sizeof FMTS[0]; i++)
    for (size_t j = 0; j < sizeof t / sizeof t[0]; j++) {
      qbad = 0;
      qrng = seed + 7919 * (i * 16 + j);
      t[j].fn(&FMTS[i]);
      qrelease();
      printf("quant %s %s: %s\n", FMTS[i].name, t[j].name, qbad ? "FAIL" : "ok");
      qbad ? (*failed)++ : (*passed)++;
    }
}
