/* Parity cases of the low-precision entries with quantized weights: linear_lp_workspace,
 * linear_forward_lp, linear_backward_lp and embedding_forward_lp with wdt one of llama.cpp's
 * GGUF block formats (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) or int8 rows (a float32 scale, then
 * K int8), on random rows (random bytes for the quants and packed scales, random finite
 * float16 scales, subnormals among them).
 *
 * The reference dequantizer here is written from the gguf package's dequantize_blocks
 * (gguf-py/gguf/quants.py): its numpy reshapes spelled out as loops, its float32 operations
 * in its order, each rounded to float32 on its own (volatile: the compiler may not fuse a
 * product into an FMA), float16 decoded with ldexp.  So the embedding, which only
 * dequantizes, must match it bit for bit; the linear entries are checked against a float64
 * GEMM of those values with the accumulation tolerance of test_kernels.h, plus, when the
 * table rounds activations (CUDA's panel path for M > Q_GEMV_MAX_M), two bfloat16
 * roundings per product (x or dy, and the dequantized w). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "test_kernels.h"

#define Q_GEMV_MAX_M 8     /* CUDA's decode GEMV (lowp.cu, quant.cuh): float32 x and w, no rounding */
#define BF16_U (1.0 / 256) /* bfloat16's unit roundoff */

static const tp_dtype_t QFMTS[] = {TP_Q8_0, TP_Q4_0, TP_Q4_1, TP_Q4_K, TP_Q5_K, TP_Q6_K, TP_INT8};
#define NQ (sizeof QFMTS / sizeof QFMTS[0])

int quant_table(const tp_kernel_ops *k) {
  /* the tables whose lp entries take quantized formats (every one now: cpu/lowp.c through
   * cpu/quant.c, cuda/lowp.cu through cuda/quant.cu) */
  return !strcmp(k->name, "cpu") || !strcmp(k->name, "cuda") || !strcmp(k->name, "cudaemu");
}

/* ------------------------------------------------------------------ formats */

static int64_t qblock(tp_dtype_t f) {
  int64_t b = 0;
  if (!tp_weight_format(f, &b, NULL, NULL)) fail("tp_weight_format(%s) refused a weight format", tp_dtype_name(f));
  return b;
}

static size_t qrow_bytes(tp_dtype_t f, int64_t K) {
  size_t b = 0;
  if (!tp_weight_row_bytes(f, K, &b)) fail("tp_weight_row_bytes(%s, %lld) refused", tp_dtype_name(f), (long long)K);
  return b;
}

/* The value of a float16 pattern (never inf / NaN here). */
static float half_value(const uint8_t *p) {
  unsigned h = p[0] | (unsigned)p[1] << 8, e = (h >> 10) & 31, m = h & 1023;
  double v = e ? ldexp(1024 + m, (int)e - 25) : ldexp(m, -24);
  return (float)(h >> 15 ? -v : v);
}

/* A random finite float16 of magnitude about 2^-12 .. 2^-2, sometimes subnormal, either sign. */
static void rnd_half(uint8_t *p) {
  uint64_t r = rnd_u64();
  unsigned e = r % 16 == 0 ? 0 : 3 + (unsigned)((r >> 8) % 11), h = (unsigned)(r >> 20) & 1023;
  h |= e << 10 | (unsigned)((r >> 40) & 1) << 15;
  p[0] = (uint8_t)h, p[1] = (uint8_t)(h >> 8);
}

static float mul32(float a, float b) {
  volatile float r = a * b;
  return r;
}
static float add32(float a, float b) {
  volatile float r = a + b;
  return r;
}

/* N random rows of K elements in format f (K a multiple of its block). */
static uint8_t *rnd_qrows(tp_dtype_t f, int64_t N, int64_t K) {
  size_t rb = qrow_bytes(f, K);
  uint8_t *w = hmem(rb * (size_t)N + 1);
  for (size_t i = 0; i < rb * (size_t)N; i++) w[i] = (uint8_t)rnd_u64();
  int64_t blk = qblock(f), nb = K / blk;
  size_t bb = 0;
  tp_weight_format(f, NULL, &bb, NULL);
  for (int64_t n = 0; n < N; n++) {
    uint8_t *row = w + rb * (size_t)n;
    if (f == TP_INT8) {
      float sc = (float)ldexp(1 + (double)(rnd_u64() % 1000) / 1000, -(int)(rnd_u64() % 9)) * (rnd_u64() & 1 ? -1 : 1);
      memcpy(row, &sc, 4);
      continue;
    }
    for (int64_t b = 0; b < nb; b++) { /* the float16 fields; the rest stays random bytes */
      uint8_t *p = row + bb * (size_t)b;
      switch (f) {
        case TP_Q8_0:
        case TP_Q4_0: rnd_half(p); break;
        case TP_Q4_1:
        case TP_Q4_K:
        case TP_Q5_K: rnd_half(p), rnd_half(p + 2); break;
        case TP_Q6_K: rnd_half(p + 208); break;
        default: break;
      }
    }
  }
  return w;
}

/* get_scale_min of gguf's Q4_K: scales viewed as 3 x 4 bytes d, m, m_d. */
static void scale_min(const uint8_t *s, int sc[8], int mn[8]) {
  const uint8_t *d = s, *m = s + 4, *md = s + 8;
  for (int j = 0; j < 4; j++) {
    sc[j] = d[j] & 0x3F, sc[j + 4] = (md[j] & 0x0F) | ((d[j] >> 2) & 0x30);
    mn[j] = m[j] & 0x3F, mn[j + 4] = (md[j] >> 4) | ((m[j] >> 2) & 0x30);
  }
}

/* y[K] = the row's values (gguf's dequantize_blocks, float32). */
static void ref_row(tp_dtype_t f, const uint8_t *row, int64_t K, float *y) {
  if (f == TP_INT8) {
    float sc;
    memcpy(&sc, row, 4);
    for (int64_t k = 0; k < K; k++) y[k] = mul32(sc, (float)(int8_t)row[4 + k]);
    return;
  }
  int64_t blk = qblock(f);
  size_t bb = 0;
  tp_weight_format(f, NULL, &bb, NULL);
  for (int64_t b = 0; b < K / blk; b++, y += blk) {
    const uint8_t *p = row + bb * (size_t)b;
    switch (f) {
      case TP_Q8_0: { /* x * d */
        float d = half_value(p);
        for (int i = 0; i < 32; i++) y[i] = mul32((float)(int8_t)p[2 + i], d);
        break;
      }
      case TP_Q4_0:
      case TP_Q4_1: { /* qs (16) >> [0, 4]: nibble i of byte i first, then the high nibbles */
        int q1 = f == TP_Q4_1;
        float d = half_value(p), m = q1 ? half_value(p + 2) : 0;
        const uint8_t *qs = p + (q1 ? 4 : 2);
        for (int half = 0; half < 2; half++)
          for (int i = 0; i < 16; i++) {
            int q = (qs[i] >> (4 * half)) & 0x0F;
            y[16 * half + i] = q1 ? add32(mul32(d, (float)q), m) : mul32(d, (float)(q - 8));
          }
        break;
      }
      case TP_Q4_K:
      case TP_Q5_K: { /* (d sc) q - (dmin m); qs (4, 32) >> [0, 4] -> 8 sub-blocks of 32 */
        int q5 = f == TP_Q5_K, sc[8], mn[8];
        float d = half_value(p), dmin = half_value(p + 2);
        scale_min(p + 4, sc, mn);
        const uint8_t *qh = p + 16, *qs = p + (q5 ? 48 : 16);
        for (int c = 0; c < 4; c++)
          for (int half = 0; half < 2; half++) {
            int j = 2 * c + half;
            float ds = mul32(d, (float)sc[j]), dm = mul32(dmin, (float)mn[j]);
            for (int i = 0; i < 32; i++) {
              int q = (qs[32 * c + i] >> (4 * half)) & 0x0F;
              if (q5) q |= ((qh[i] >> j) & 1) << 4; /* qh (1, 32) >> [0..7]: bit j for sub-block j */
              y[32 * j + i] = add32(mul32(ds, (float)q), -dm);
            }
          }
        break;
      }
      case TP_Q6_K: { /* ql (2, 64) >> [0, 4], qh (2, 32) >> [0, 2, 4, 6]; (d scale) q */
        const uint8_t *ql = p, *qh = p + 128;
        const int8_t *scales = (const int8_t *)(p + 192);
        float d = half_value(p + 208);
        for (int h = 0; h < 2; h++)
          for (int r = 0; r < 128; r++) {
            int lo = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0x0F, hi = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
            int e = 128 * h + r;
            y[e] = mul32(mul32(d, (float)scales[e / 16]), (float)((int8_t)(lo | hi << 4) - 32));
          }
        break;
      }
      default: fail("no reference dequantizer for %s", tp_dtype_name(f)); return;
    }
  }
}

/* The N x K weight's values in double. */
static double *ref_rows(tp_dtype_t f, const uint8_t *w, int64_t N, int64_t K) {
  double *v = dz(N * K + 1);
  float *t = hmem((size_t)K * 4 + 4);
  size_t rb = qrow_bytes(f, K);
  for (int64_t n = 0; n < N; n++) {
    ref_row(f, w + rb * (size_t)n, K, t);
    for (int64_t k = 0; k < K; k++) v[n * K + k] = t[k];
  }
  return v;
}

/* Row lengths per format: one block, several blocks; int8 rows any K. */
static int64_t qk(tp_dtype_t f, int i) {
  static const int64_t int8k[] = {1, 37, 300};
  return f == TP_INT8 ? int8k[i] : qblock(f) * (i == 0 ? 1 : i == 1 ? 3 : 5);
}

static int is_cuda(void) { return !strncmp(K->name, "cuda", 4); }

/* CUDA's panel path accepts any workspace holding the rounded activations (256-aligned)
 * and one panel row (lowp.cu): this much leaves room for 3 rows, so N > 3 takes several
 * panels. */
static size_t small_ws(int64_t first_elems, int64_t Kd) {
  return (((size_t)first_elems * 2 + 255) & ~(size_t)255) + (size_t)Kd * 2 * 3 + 5;
}

/* ------------------------------------------------------------------ entries */

void case_quant_embedding_forward_lp(void) {
  const int64_t Ms[] = {0, 1, 9};
  for (size_t fi = 0; fi < NQ; fi++)
    for (int ki = 0; ki < 3; ki++)
      for (size_t mi = 0; mi < 3; mi++) {
        tp_dtype_t f = QFMTS[fi];
        int64_t M = Ms[mi], C = qk(f, ki), V = 7, lo = 10, *tok = hmem((size_t)M * 8 + 8);
        for (int64_t m = 0; m < M; m++) tok[m] = rnd_int(5, 20); /* some outside the shard [10, 17) */
        if (M > 2) tok[0] = INT64_MIN, tok[1] = INT64_MAX, tok[2] = lo + V - 1;
        uint8_t *table = rnd_qrows(f, V, C);
        double *tv = ref_rows(f, table, V, C), *ref = dz(M * C + 1);
        for (int64_t m = 0; m < M; m++)
          for (int64_t j = 0; j < C; j++)
            ref[m * C + j] = tok[m] >= lo && tok[m] < lo + V ? tv[(tok[m] - lo) * C + j] : 0;
        float *out = rnd(M * C, -1, 1), *dout = DPUTF(out, M * C);
        ok("embedding_forward_lp", K->embedding_forward_lp(NULL, dout, DPUTI(tok, M),
                                                           dput(table, qrow_bytes(f, C) * (size_t)V), f, M, lo, V, C));
        GETF(out, dout, M * C);
        expect(tp_dtype_name(f), out, ref, M * C, 0, 0, NULL); /* dequantization is exact */
      }
  /* a row that is not whole blocks: refused by every table */
  float o[4];
  int64_t t = 0;
  tp_status_t st = K->embedding_forward_lp(NULL, DPUTF(o, 4), DPUTI(&t, 1), dmem(64), TP_Q4_0, 1, 0, 1, 31);
  if (st != TP_ERR_INVALID_ARGUMENT) fail("embedding_forward_lp, q4_0 rows of 31: status %s", tp_status_name(st));
}

/* A forward on the device with a given workspace; y checked against the reference. */
static void qforward_check(tp_dtype_t f, int64_t M, int64_t Kd, int64_t N, const float *x, const uint8_t *w,
                           const float *b, const double *ref, const double *mag, void *ws, size_t wsb) {
  float *y = rnd(M * N, -1, 1), *dy = DPUTF(y, M * N); /* garbage: it must be overwritten */
  ok("linear_forward_lp", K->linear_forward_lp(NULL, dy, DPUTF(x, M * Kd), dput(w, qrow_bytes(f, Kd) * (size_t)N), f,
                                               b ? DPUTF(b, N) : NULL, M, Kd, N, ws, wsb));
  GETF(y, dy, M * N);
  double tol = 2 * (double)(Kd + 3) * U + (K->lp_rounds_activations && M > Q_GEMV_MAX_M ? 2 * 1.01 * BF16_U : 0);
  char what[64];
  snprintf(what, sizeof what, "%s y (M %lld, K %lld, N %lld)", tp_dtype_name(f), (long long)M, (long long)Kd,
           (long long)N);
  expect(what, y, ref, M * N, tol, 0, mag);
}

void case_quant_linear_forward_lp(void) {
  const int64_t MN[][2] = {{1, 1}, {1, 37}, {3, 8}, {8, 5}, {9, 7}, {21, 33}};
  for (size_t fi = 0; fi < NQ; fi++)
    for (size_t c = 0; c < sizeof MN / sizeof MN[0]; c++) {
      tp_dtype_t f = QFMTS[fi];
      int64_t M = MN[c][0], N = MN[c][1], Kd = qk(f, (int)((c + fi) % 3));
      int bias = (c + fi) & 1;
      uint8_t *w = rnd_qrows(f, N, Kd);
      double *wv = ref_rows(f, w, N, Kd);
      float *x = rnd(M * Kd, -1, 1), *b = bias ? rnd(N, -1, 1) : NULL;
      double *ref = dz(M * N + 1), *mag = dz(M * N + 1);
      for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
          double s = bias ? b[n] : 0, a = fabs(s);
          for (int64_t k = 0; k < Kd; k++)
            s += x[m * Kd + k] * wv[n * Kd + k], a += fabs(x[m * Kd + k] * wv[n * Kd + k]);
          ref[m * N + n] = s, mag[m * N + n] = a;
        }
      size_t wsb = K->linear_lp_workspace(M, Kd, N, f, 0);
      qforward_check(f, M, Kd, N, x, w, b, ref, mag, wsb ? dmem(wsb) : NULL, wsb);
      if (is_cuda() && M > Q_GEMV_MAX_M) { /* several panels */
        size_t s = small_ws(M * Kd, Kd);
        qforward_check(f, M, Kd, N, x, w, b, ref, mag, dmem(s), s);
      }
    }
  /* refusals with y untouched: K not whole blocks (every table); (CUDA's panel path) a
   * workspace without room for one panel row (the CPU's entries take any workspace) */
  float y0[4] = {1, 2, 3, 4}, y1[4];
  float *dy = DPUTF(y0, 4), *x = DPUTF(y0, 4);
  tp_status_t st = K->linear_forward_lp(NULL, dy, x, dmem(256), TP_Q8_0, NULL, 1, 40, 4, dmem(4096), 4096);
  if (st != TP_ERR_INVALID_ARGUMENT) fail("linear_forward_lp, q8_0 with K = 40: status %s", tp_status_name(st));
  GETF(y1, dy, 4);
  if (memcmp(y0, y1, sizeof y0)) fail("linear_forward_lp wrote y before refusing K = 40");
  if (!is_cuda()) return;
  int64_t M = 9, Kd = 256;
  float *y2 = rnd(M * 4, -1, 1), *y3 = hmem((size_t)M * 16), *dy2 = DPUTF(y2, M * 4);
  size_t s = (((size_t)(M * Kd) * 2 + 255) & ~(size_t)255) + (size_t)Kd * 2 - 1; /* x16, one row short of a byte */
  st = K->linear_forward_lp(NULL, dy2, DPUTF(rnd(M * Kd, -1, 1), M * Kd), dput(rnd_qrows(TP_Q4_K, 4, Kd), 4 * 144),
                            TP_Q4_K, NULL, M, Kd, 4, dmem(s), s);
  if (st != TP_ERR_INVALID_ARGUMENT)
    fail("linear_forward_lp, q4_k, workspace short of a panel row: status %s", tp_status_name(st));
  GETF(y3, dy2, M * 4);
  if (memcmp(y2, y3, (size_t)M * 16)) fail("linear_forward_lp wrote y before refusing its workspace");
}

void case_quant_linear_backward_lp(void) {
  const int64_t MN[][2] = {{1, 5}, {4, 1}, {12, 9}, {7, 33}};
  for (size_t fi = 0; fi < NQ; fi++)
    for (size_t c = 0; c < sizeof MN / sizeof MN[0]; c++)
      for (int acc = 0; acc < 2; acc++) {
        tp_dtype_t f = QFMTS[fi];
        int64_t M = MN[c][0], N = MN[c][1], Kd = qk(f, (int)((c + fi + acc) % 3));
        uint8_t *w = rnd_qrows(f, N, Kd);
        double *wv = ref_rows(f, w, N, Kd);
        float *dy = rnd(M * N, -1, 1), *dx0 = rnd(M * Kd, -1, 1), *db0 = rnd(N, -1, 1);
        double *rdx = dz(M * Kd + 1), *mdx = dz(M * Kd + 1), *rdb = dz(N + 1), *mdb = dz(N + 1);
        for (int64_t m = 0; m < M; m++)
          for (int64_t k = 0; k < Kd; k++) {
            double s = acc ? dx0[m * Kd + k] : 0, a = fabs(s);
            for (int64_t n = 0; n < N; n++)
              s += dy[m * N + n] * wv[n * Kd + k], a += fabs(dy[m * N + n] * wv[n * Kd + k]);
            rdx[m * Kd + k] = s, mdx[m * Kd + k] = a;
          }
        for (int64_t n = 0; n < N; n++) {
          rdb[n] = db0[n], mdb[n] = fabs(db0[n]);
          for (int64_t m = 0; m < M; m++) rdb[n] += dy[m * N + n], mdb[n] += fabs(dy[m * N + n]);
        }
        size_t wsb = K->linear_lp_workspace(M, Kd, N, f, 1), sws = small_ws(M * N, Kd);
        for (int small = 0; small < 1 + (is_cuda() && N > 3); small++) {
          float *dx = hmem((size_t)(M * Kd) * 4 + 4), *db = hmem((size_t)N * 4 + 4);
          float *ddx = DPUTF(dx0, M * Kd), *ddb = DPUTF(db0, N);
          size_t nb = small ? sws : wsb;
          ok("linear_backward_lp",
             K->linear_backward_lp(NULL, ddx, NULL, ddb, DPUTF(dy, M * N), DPUTF(dx0, M * Kd),
                                   dput(w, qrow_bytes(f, Kd) * (size_t)N), f, M, Kd, N, acc, nb ? dmem(nb) : NULL, nb));
          GETF(dx, ddx, M * Kd), GETF(db, ddb, N);
          char what[64];
          snprintf(what, sizeof what, "%s dx (M %lld, K %lld, N %lld, acc %d)", tp_dtype_name(f), (long long)M,
                   (long long)Kd, (long long)N, acc);
          expect(what, dx, rdx, M * Kd, 2 * (double)(N + 3) * U + (K->lp_rounds_activations ? 2 * 1.01 * BF16_U : 0), 0,
                 mdx);
          expect("db", db, rdb, N, 2 * (double)(M + 3) * U, 0, mdb);
        }
      }
  /* dw with a quantized weight (frozen): every table refuses it before anything is written */
  int64_t M = 3, Kd = 64, N = 5;
  float *dx0 = rnd(M * Kd, -1, 1), *dw0 = rnd(N * Kd, -1, 1), *db0 = rnd(N, -1, 1);
  float *ddx = DPUTF(dx0, M * Kd), *ddw = DPUTF(dw0, N * Kd), *ddb = DPUTF(db0, N);
  size_t wsb = K->linear_lp_workspace(M, Kd, N, TP_Q8_0, 1);
  tp_status_t st = K->linear_backward_lp(NULL, ddx, ddw, ddb, DPUTF(rnd(M * N, -1, 1), M * N),
                                         DPUTF(rnd(M * Kd, -1, 1), M * Kd), dput(rnd_qrows(TP_Q8_0, N, Kd), 34 * 2 * 5),
                                         TP_Q8_0, M, Kd, N, 0, wsb ? dmem(wsb) : NULL, wsb);
  if (st != TP_ERR_INVALID_ARGUMENT || !strstr(tp_last_error(), "dw"))
    fail("linear_backward_lp with dw and q8_0 weights: status %s (%s)", tp_status_name(st), tp_last_error());
  float *dx = hmem((size_t)(M * Kd) * 4), *dw = hmem((size_t)(N * Kd) * 4), *db = hmem((size_t)N * 4);
  GETF(dx, ddx, M * Kd), GETF(dw, ddw, N * Kd), GETF(db, ddb, N);
  if (memcmp(dx, dx0, (size_t)(M * Kd) * 4) || memcmp(dw, dw0, (size_t)(N * Kd) * 4) || memcmp(db, db0, (size_t)N * 4))
    fail("linear_backward_lp wrote an output before refusing dw");
}

/* A function of its arguments, and never a float32 (nor bfloat16) copy of a large weight. */
void case_quant_linear_lp_workspace(void) {
  for (size_t fi = 0; fi < NQ; fi++)
    for (int bw = 0; bw < 2; bw++) {
      tp_dtype_t f = QFMTS[fi];
      const int64_t sz[][3] = {{1, 1, 1}, {9, 3, 7}, {100, 5, 300}};
      for (int c = 0; c < 3; c++) {
        int64_t M = sz[c][0], Kd = qk(f, (int)sz[c][1] % 3), N = sz[c][2];
        if (K->linear_lp_workspace(M, Kd, N, f, bw) != K->linear_lp_workspace(M, Kd, N, f, bw))
          fail("linear_lp_workspace(%lld, %lld, %lld, %s) changed between calls", (long long)M, (long long)Kd,
               (long long)N, tp_dtype_name(f));
      }
      int64_t M = 64, Kd = 8192, N = 32768;
      size_t nbytes = K->linear_lp_workspace(M, Kd, N, f, bw);
      if (nbytes >= (size_t)(N * Kd) * 2)
        fail("linear_lp_workspace(%lld, %lld, %lld, %s, %d) = %zu: a 16-bit copy of w or more", (long long)M,
             (long long)Kd, (long long)N, tp_dtype_name(f), bw, nbytes);
    }
}
