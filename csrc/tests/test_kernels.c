/*
 * The kernel parity harness: every entry of every available kernel table (the CPU's,
 * and CUDA's when a build has one: the same loop over devices with tp_kernels_of)
 * against double-precision references written here (test_kernels.h has the tolerance
 * rules).  Prints the table's entries ("entries: ..."), one line per entry per device,
 * the entries that had a case ("covered: ..."), and "N passed, N failed"; exits
 * non-zero on any failure or on an entry without a case.  Runs without Python.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <stdarg.h>

#include "test_kernels.h"

const tp_kernel_ops *K;
tp_device_t DEV;

/* ------------------------------------------------------------------ harness */

static int case_failed;
static double worst; /* the largest |err| / tol of the entry */
static void *hpool[4096], *dpool[4096];
static int nh, nd;
static uint64_t rng = 0x2545F4914F6CDD1DULL;

void fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  printf("    ");
  vprintf(fmt, ap);
  printf("\n");
  va_end(ap);
  case_failed = 1;
}

void ok(const char *what, tp_status_t st) {
  if (st != TP_SUCCESS) fail("%s: status %s (%s)", what, tp_status_name(st), tp_last_error());
}

void expect(const char *what, const float *got, const double *ref, int64_t n, double atol, double rtol,
            const double *mag) {
  for (int64_t i = 0; i < n; i++) {
    double tol = atol * (mag ? mag[i] : 1.0) + rtol * fabs(ref[i]) + 1e-300, err = fabs((double)got[i] - ref[i]);
    if (isinf(ref[i]) && got[i] == ref[i]) continue;
    if (!(err <= tol)) { /* NaN fails too */
      fail("%s[%lld] = %.9g, reference %.9g (|err| %.3g > tol %.3g)", what, (long long)i, (double)got[i], ref[i], err,
           tol);
      return;
    }
    if (err / tol > worst) worst = err / tol;
  }
}

void expect_i64(const char *what, const int64_t *got, const int64_t *ref, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    if (got[i] != ref[i]) {
      fail("%s[%lld] = %lld, reference %lld", what, (long long)i, (long long)got[i], (long long)ref[i]);
      return;
    }
}

void *hmem(size_t nbytes) {
  void *p = calloc(1, nbytes ? nbytes : 1);
  if (!p || nh == 4096) {
    printf("out of host memory in the harness\n");
    exit(2);
  }
  return hpool[nh++] = p;
}

uint64_t rnd_u64(void) { /* splitmix64 */
  uint64_t z = (rng += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

int64_t rnd_int(int64_t lo, int64_t hi) { return lo + (int64_t)(rnd_u64() % (uint64_t)(hi - lo)); }

float *rnd(int64_t n, double lo, double hi) {
  float *p = hmem((size_t)n * sizeof(float));
  for (int64_t i = 0; i < n; i++) p[i] = (float)(lo + (hi - lo) * (double)(rnd_u64() >> 11) / 9007199254740992.0);
  return p;
}

double *dz(int64_t n) { return hmem((size_t)n * sizeof(double)); }

void *dmem(size_t nbytes) {
  void *p = NULL;
  if (tp_device_alloc(DEV, 0, nbytes ? nbytes : 1, &p) != TP_SUCCESS || nd == 4096) {
    printf("device alloc failed: %s\n", tp_last_error());
    exit(2);
  }
  return dpool[nd++] = p;
}

void *dput(const void *host, size_t nbytes) {
  void *p = dmem(nbytes);
  if (nbytes && tp_device_copy(DEV, p, TP_DEVICE_CPU, host, nbytes, NULL) != TP_SUCCESS) {
    printf("device copy failed: %s\n", tp_last_error());
    exit(2);
  }
  return p;
}

void dget(void *host, const void *dev, size_t nbytes) {
  if (!nbytes) return;
  if (tp_device_copy(TP_DEVICE_CPU, host, DEV, dev, nbytes, NULL) != TP_SUCCESS ||
      tp_device_sync(DEV, 0, NULL) != TP_SUCCESS) {
    printf("device copy back failed: %s\n", tp_last_error());
    exit(2);
  }
}

static void release(void) {
  while (nh) free(hpool[--nh]);
  while (nd) tp_device_free(DEV, 0, dpool[--nd]);
}

/* ------------------------------------------------------ GEMM, bias, element-wise */

static void case_gemm(void) {
  const int64_t sz[][3] = {{0, 3, 2}, {1, 1, 1}, {3, 5, 0}, {5, 7, 9}, {17, 33, 65}, {2, 1, 13}};
  for (size_t c = 0; c < sizeof sz / sizeof sz[0]; c++)
    for (int t = 0; t < 8; t++) {
      int64_t M = sz[c][0], N = sz[c][1], Kd = sz[c][2];
      int ta = t & 1, tb = (t >> 1) & 1;
      float alpha = 0.7f, beta = (t >> 2) ? 0.5f : 0.0f;
      int64_t ar = ta ? Kd : M, ac = ta ? M : Kd, br = tb ? N : Kd, bc = tb ? Kd : N;
      int64_t lda = ac + 3, ldb = bc + 1, ldc = N + 2; /* padded rows: leading dimensions are honoured */
      float *A = rnd(ar * lda + 1, -1, 1), *B = rnd(br * ldb + 1, -1, 1), *C = rnd(M * ldc + 1, -1, 1);
      double *ref = dz(M * ldc + 1), *mag = dz(M * ldc + 1);
      for (int64_t i = 0; i < M * ldc; i++) ref[i] = C[i], mag[i] = 0;
      for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
          double s = 0, a = 0;
          for (int64_t k = 0; k < Kd; k++) {
            double x = ta ? A[k * lda + m] : A[m * lda + k], y = tb ? B[n * ldb + k] : B[k * ldb + n];
            s += x * y, a += fabs(x * y);
          }
          ref[m * ldc + n] = alpha * s + beta * C[m * ldc + n];
          mag[m * ldc + n] = alpha * a + fabs(beta * C[m * ldc + n]);
        }
      float *dA = DPUTF(A, ar * lda + 1), *dB = DPUTF(B, br * ldb + 1), *dC = DPUTF(C, M * ldc + 1);
      ok("gemm", K->gemm(NULL, ta, tb, M, N, Kd, alpha, dA, lda, dB, ldb, beta, dC, ldc));
      GETF(C, dC, M * ldc);
      expect("C", C, ref, M * ldc, 2 * (Kd + 2) * U, U, mag); /* padding columns: unchanged, exactly */
    }
}

static void case_add_bias(void) {
  const int64_t sz[][2] = {{0, 3}, {1, 1}, {3, 17}, {9, 33}, {2, 0}};
  for (size_t c = 0; c < sizeof sz / sizeof sz[0]; c++)
    for (int inplace = 0; inplace < 2; inplace++) {
      int64_t M = sz[c][0], N = sz[c][1];
      float *x = rnd(M * N, -2, 2), *b = rnd(N, -1, 1), *y = hmem((size_t)(M * N + 1) * sizeof(float));
      double *ref = dz(M * N + 1);
      for (int64_t i = 0; i < M * N; i++) ref[i] = (double)x[i] + b[i % N];
      float *dx = DPUTF(x, M * N), *db = DPUTF(b, N), *dy = inplace ? dx : dmem((size_t)(M * N) * 4);
      ok("add_bias", K->add_bias(NULL, dy, dx, db, M, N));
      GETF(y, dy, M * N);
      expect("y", y, ref, M * N, 0, U, NULL); /* one rounding */
    }
}

static void case_bias_grad(void) {
  const int64_t sz[][2] = {{0, 3}, {1, 1}, {3, 17}, {33, 9}, {2, 0}};
  for (size_t c = 0; c < sizeof sz / sizeof sz[0]; c++) {
    int64_t M = sz[c][0], N = sz[c][1];
    float *dy = rnd(M * N, -1, 1), *db = rnd(N, -1, 1);
    double *ref = dz(N), *mag = dz(N);
    for (int64_t n = 0; n < N; n++) {
      ref[n] = db[n], mag[n] = fabs(db[n]);
      for (int64_t m = 0; m < M; m++) ref[n] += dy[m * N + n], mag[n] += fabs(dy[m * N + n]);
    }
    float *ddb = DPUTF(db, N);
    ok("bias_grad", K->bias_grad(NULL, ddb, DPUTF(dy, M * N), M, N));
    GETF(db, ddb, N);
    expect("db", db, ref, N, 2 * (M + 2) * U, 0, mag); /* a sum of M + 1 terms */
  }
}

typedef tp_status_t (*binop)(tp_stream_t, float *, const float *, const float *, int64_t);

static void flat_binop(binop f, double sign, const char *name) {
  const int64_t ns[] = {0, 1, 7, 33, 1025};
  for (size_t c = 0; c < sizeof ns / sizeof ns[0]; c++)
    for (int alias = 0; alias < 3; alias++) { /* y separate, y = a, y = b */
      int64_t n = ns[c];
      float *a = rnd(n, -3, 3), *b = rnd(n, -3, 3), *y = hmem((size_t)n * 4 + 4);
      double *ref = dz(n + 1);
      for (int64_t i = 0; i < n; i++) ref[i] = (double)a[i] + sign * b[i];
      float *da = DPUTF(a, n), *db = DPUTF(b, n), *dy = alias == 1 ? da : alias == 2 ? db : dmem((size_t)n * 4);
      ok(name, f(NULL, dy, da, db, n));
      GETF(y, dy, n);
      expect("y", y, ref, n, 0, U, NULL);
    }
}

static void case_add(void) { flat_binop(K->add, 1.0, "add"); }
static void case_sub(void) { flat_binop(K->sub, -1.0, "sub"); }

static void case_scale(void) {
  const int64_t ns[] = {0, 1, 7, 1025};
  for (size_t c = 0; c < 4; c++)
    for (int inplace = 0; inplace < 2; inplace++) {
      int64_t n = ns[c];
      float *x = rnd(n, -3, 3), *y = hmem((size_t)n * 4 + 4), alpha = -0.37f;
      double *ref = dz(n + 1);
      for (int64_t i = 0; i < n; i++) ref[i] = (double)alpha * x[i];
      float *dx = DPUTF(x, n), *dy = inplace ? dx : dmem((size_t)n * 4);
      ok("scale", K->scale(NULL, dy, dx, alpha, n));
      GETF(y, dy, n);
      expect("y", y, ref, n, 0, U, NULL);
    }
}

static void case_fill(void) {
  const int64_t ns[] = {0, 1, 7, 1025};
  for (size_t c = 0; c < 4; c++) {
    int64_t n = ns[c];
    float *y = rnd(n + 1, -1, 1);
    double *ref = dz(n + 1);
    for (int64_t i = 0; i < n; i++) ref[i] = 1.25;
    ref[n] = y[n];
    float *dy = DPUTF(y, n + 1);
    ok("fill", K->fill(NULL, dy, 1.25f, n));
    GETF(y, dy, n + 1);
    expect("y", y, ref, n + 1, 0, 0, NULL); /* exact, and the element past n untouched */
  }
}

/* The seeded streams, from their definition (core_impl.h's tp_uniform01 is the spec). */
static double uni(uint64_t seed, uint64_t tensor, uint64_t index) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ULL ^ (tensor + 1) * 0xD1B54A32D192ED03ULL ^ index * 0x94D049BB133111EBULL;
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  z ^= z >> 31;
  return (double)(z >> 11) / 9007199254740992.0;
}

static void case_init_uniform(void) {
  const int64_t ns[] = {0, 1, 7, 333};
  for (size_t c = 0; c < 4; c++) {
    int64_t n = ns[c];
    uint64_t seed = 1234 + c, idx0 = 17 * c;
    float *y = hmem((size_t)n * 4 + 4), bound = 0.3f;
    double *ref = dz(n + 1);
    for (int64_t i = 0; i < n; i++) ref[i] = (2.0 * uni(seed, 5, idx0 + (uint64_t)i) - 1.0) * bound;
    float *dy = dmem((size_t)n * 4);
    ok("init_uniform", K->init_uniform(NULL, dy, n, seed, 5, idx0, bound));
    GETF(y, dy, n);
    expect("y", y, ref, n, 0, U, NULL);
  }
}

static void case_init_normal(void) {
  const int64_t ns[] = {0, 1, 2, 7, 334};
  for (size_t c = 0; c < 5; c++)
    for (uint64_t idx0 = 0; idx0 < 2; idx0++) { /* starting on a pair's first or second half */
      int64_t n = ns[c];
      uint64_t seed = 99 + c;
      float *y = hmem((size_t)n * 4 + 4);
      double *ref = dz(n + 1);
      for (int64_t i = 0; i < n; i++) {
        uint64_t e = idx0 + (uint64_t)i, p = e / 2;
        double u1 = uni(seed, 2, 2 * p), u2 = uni(seed, 2, 2 * p + 1), r = sqrt(-2.0 * log(1.0 - u1));
        ref[i] = e % 2 ? r * sin(2 * M_PI * u2) : r * cos(2 * M_PI * u2);
      }
      float *dy = dmem((size_t)n * 4);
      ok("init_normal", K->init_normal(NULL, dy, n, seed, 2, idx0));
      GETF(y, dy, n);
      expect("y", y, ref, n, 1e-12, 2 * U, NULL); /* float of a double: one rounding (+ libm's last bits) */
    }
}

/* ------------------------------------------------------------ positions, KV cache */

static void case_positions(void) {
  for (int64_t B = 0; B < 4; B += 1 + (B == 1))
    for (int64_t T = 0; T < 5; T += 1 + 2 * (T == 1)) {
      int64_t *pos0 = hmem((size_t)B * 8 + 8), *pos = hmem((size_t)(B * T) * 8 + 8), *kl = hmem((size_t)B * 8 + 8);
      int64_t *rp = hmem((size_t)(B * T) * 8 + 8), *rk = hmem((size_t)B * 8 + 8);
      for (int64_t b = 0; b < B; b++) {
        pos0[b] = rnd_int(0, 1000);
        rk[b] = pos0[b] + T;
        for (int64_t t = 0; t < T; t++) rp[b * T + t] = pos0[b] + t;
      }
      for (int with_klen = 0; with_klen < 2; with_klen++) {
        int64_t *dp = dmem((size_t)(B * T) * 8), *dk = with_klen ? dmem((size_t)B * 8) : NULL;
        ok("positions", K->positions(NULL, dp, dk, DPUTI(pos0, B), B, T));
        GETI(pos, dp, B * T);
        expect_i64("pos", pos, rp, B * T);
        if (dk) {
          GETI(kl, dk, B);
          expect_i64("klen", kl, rk, B);
        }
      }
    }
}

static void case_kv_cache_write(void) {
  /* B, T, max_len, width, ld, cache sequences (0: B, no slots; else slots: a permutation's first B),
   * ring (0: none; else positions anywhere in [0, 60), row p % ring; T > ring: the last ring rows) */
  const int64_t cfg[][7] = {{3, 2, 7, 5, 13, 0, 0}, {1, 1, 1, 1, 1, 0, 0}, {2, 3, 9, 0, 4, 0, 0},
                            {0, 2, 4, 3, 3, 0, 0},  {2, 0, 4, 3, 3, 0, 0}, {3, 2, 7, 5, 13, 5, 0},
                            {1, 4, 4, 3, 3, 3, 0},  {4, 1, 6, 7, 9, 4, 0}, {3, 2, 7, 5, 13, 0, 4},
                            {2, 5, 6, 3, 4, 3, 3},  {2, 3, 5, 4, 4, 0, 5}, {1, 1, 1, 2, 2, 0, 1}};
  for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
    int64_t B = cfg[c][0], T = cfg[c][1], L = cfg[c][2], W = cfg[c][3], ld = cfg[c][4], S = cfg[c][5];
    int64_t ring = cfg[c][6];
    int64_t nseq = S ? S : (B ? B : 1), nc = nseq * L * W, nr = B * T * ld;
    float *kc = rnd(nc, -1, 1), *vc = rnd(nc, -1, 1), *k = rnd(nr + W, -1, 1), *v = rnd(nr + W, -1, 1);
    int64_t *pos0 = hmem((size_t)B * 8 + 8), *slots = S ? hmem((size_t)S * 8) : NULL;
    for (int64_t i = 0; i < S; i++) slots[i] = i;
    for (int64_t i = S - 1; i > 0; i--) { /* shuffled: distinct slots in any order */
      int64_t j = rnd_int(0, (int)i + 1), t = slots[i];
      slots[i] = slots[j], slots[j] = t;
    }
    double *rk = dz(nc), *rv = dz(nc);
    for (int64_t i = 0; i < nc; i++) rk[i] = kc[i], rv[i] = vc[i];
    for (int64_t b = 0; b < B; b++) {
      int64_t sb = slots ? slots[b] : b;
      pos0[b] = ring ? rnd_int(0, 60) : rnd_int(0, L - T + 1);
      for (int64_t t = 0; t < T; t++) /* in order: a ring row written twice keeps the later position */
        for (int64_t j = 0; j < W; j++) {
          int64_t r = ring ? (pos0[b] + t) % ring : pos0[b] + t;
          rk[(sb * L + r) * W + j] = k[(b * T + t) * ld + j];
          rv[(sb * L + r) * W + j] = v[(b * T + t) * ld + j];
        }
    }
    float *dkc = DPUTF(kc, nc), *dvc = DPUTF(vc, nc);
    ok("kv_cache_write", K->kv_cache_write(NULL, dkc, dvc, DPUTF(k, nr + W), DPUTF(v, nr + W), ld, DPUTI(pos0, B),
                                           slots ? DPUTI(slots, B) : NULL, B, T, L, W, ring));
    GETF(kc, dkc, nc);
    GETF(vc, dvc, nc);
    expect("kcache", kc, rk, nc, 0, 0, NULL); /* exact copies, the rest untouched */
    expect("vcache", vc, rv, nc, 0, 0, NULL);
  }
}

static void case_kv_cache_write_paged(void) {
  /* B, T, block size, width, ld, cols (the table's; positions past cols x bs are a padding
   * row's: skipped), blocks in the pool */
  const int64_t cfg[][7] = {{3, 2, 4, 5, 13, 4, 14}, {1, 1, 1, 1, 1, 1, 1}, {2, 7, 3, 3, 4, 5, 11},
                            {0, 2, 4, 3, 3, 2, 3},   {2, 0, 4, 3, 3, 2, 3}, {2, 3, 5, 0, 4, 1, 2},
                            {4, 1, 16, 7, 9, 2, 9},  {2, 5, 1, 2, 2, 9, 19}};
  for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
    int64_t B = cfg[c][0], T = cfg[c][1], bs = cfg[c][2], W = cfg[c][3], ld = cfg[c][4], cols = cfg[c][5];
    int64_t nb = cfg[c][6], nc = nb * bs * W, nr = B * T * ld;
    float *kc = rnd(nc, -1, 1), *vc = rnd(nc, -1, 1), *k = rnd(nr + W, -1, 1), *v = rnd(nr + W, -1, 1);
    int64_t *pos0 = hmem((size_t)B * 8 + 8), *tab = hmem((size_t)(B * cols) * 8 + 8), *perm = hmem((size_t)nb * 8);
    for (int64_t i = 0; i < nb; i++) perm[i] = i;
    for (int64_t i = nb - 1; i > 0; i--) { /* shuffled blocks: each row's its own */
      int64_t j = rnd_int(0, (int)i + 1), t = perm[i];
      perm[i] = perm[j], perm[j] = t;
    }
    for (int64_t i = 0; i < B * cols; i++) /* every third entry no block (-1); distinct blocks otherwise */
      tab[i] = i % 3 == 2 || i >= nb ? -1 : perm[i];
    double *rk = dz(nc), *rv = dz(nc);
    for (int64_t i = 0; i < nc; i++) rk[i] = kc[i], rv[i] = vc[i];
    for (int64_t b = 0; b < B; b++) {
      pos0[b] = rnd_int(0, cols * bs + 2); /* past the table at times: skipped */
      for (int64_t t = 0; t < T; t++) {
        int64_t p = pos0[b] + t, e = p / bs < cols ? tab[b * cols + p / bs] : -1;
        for (int64_t j = 0; e >= 0 && j < W; j++) {
          rk[(e * bs + p % bs) * W + j] = k[(b * T + t) * ld + j];
          rv[(e * bs + p % bs) * W + j] = v[(b * T + t) * ld + j];
        }
      }
    }
    float *dkc = DPUTF(kc, nc), *dvc = DPUTF(vc, nc);
    ok("kv_cache_write_paged", K->kv_cache_write_paged(NULL, dkc, dvc, DPUTF(k, nr + W), DPUTF(v, nr + W), ld,
                                                       DPUTI(pos0, B), DPUTI(tab, B * cols), cols, bs, B, T, W));
    GETF(kc, dkc, nc);
    GETF(vc, dvc, nc);
    expect("kcache", kc, rk, nc, 0, 0, NULL); /* exact copies, the rest untouched */
    expect("vcache", vc, rv, nc, 0, 0, NULL);
  }
}

/* ------------------------------------------------------------- checks that read data */

static void case_check_range(void) {
  const int64_t ns[] = {0, 1, 9, 1000, 2500}; /* past one block of threads (CUDA: 1024) */
  for (size_t c = 0; c < 5; c++)
    for (int plant = 0; plant < 3; plant++) { /* none, a value below, a value at hi */
      int64_t n = ns[c], *x = hmem((size_t)n * 8 + 8), res[1], want = -1;
      for (int64_t i = 0; i < n; i++) x[i] = rnd_int(-5, 10);
      if (plant && n) {
        int64_t at = n / 2;
        x[at] = plant == 1 ? -6 : 10;
        x[n - 1] = plant == 1 ? 10 : -6; /* a later bad value: the first one is reported */
        want = n == 1 ? 0 : at;
      }
      int64_t *dres = dmem(8);
      ok("check_range", K->check_range(NULL, dres, DPUTI(x, n), n, -5, 10));
      GETI(res, dres, 1);
      expect_i64("result", res, &want, 1);
    }
}

static void case_xent_targets(void) {
  const int64_t ns[] = {0, 1, 9, 301, 2500}; /* past one block of threads (CUDA: 1024) */
  for (size_t c = 0; c < 5; c++)
    for (int plant = 0; plant < 2; plant++) {
      int64_t n = ns[c], vocab = 37, ign = -100, *t = hmem((size_t)n * 8 + 8), *out = hmem((size_t)n * 8 + 8);
      int64_t *ro = hmem((size_t)n * 8 + 8), want[2] = {-1, 0}, res[2];
      for (int64_t i = 0; i < n; i++) t[i] = rnd_int(0, 4) == 0 ? ign : rnd_int(0, vocab);
      if (plant && n) t[n - 1] = vocab; /* out of range, the last row */
      for (int64_t i = 0; i < n; i++) {
        if (t[i] == ign) {
          ro[i] = -1;
          continue;
        }
        if (t[i] < 0 || t[i] >= vocab) {
          want[0] = i;
          break;
        }
        ro[i] = t[i];
        want[1]++;
      }
      int64_t *dout = dmem((size_t)n * 8), *dres = dmem(16);
      ok("xent_targets", K->xent_targets(NULL, dout, dres, DPUTI(t, n), n, ign, vocab));
      GETI(res, dres, 2);
      if (res[0] != want[0]) fail("result[0] = %lld, want %lld", (long long)res[0], (long long)want[0]);
      if (want[0] < 0) { /* the count and the mapped targets are defined when nothing is bad */
        expect_i64("result[1]", res + 1, want + 1, 1);
        GETI(out, dout, n);
        expect_i64("out", out, ro, n);
      }
    }
}

static void case_xent_targets_hash(void) {
  const int64_t ns[] = {0, 1, 9, 301};
  for (size_t c = 0; c < 4; c++) {
    int64_t n = ns[c], ign = -100, *t = hmem((size_t)n * 8 + 8);
    for (int64_t i = 0; i < n; i++) t[i] = rnd_int(-1, 50);
    /* FNV-1a style over (n, ignore_index, targets), folded to 24 bits (vocab.c's fingerprint) */
    uint64_t h = (0xcbf29ce484222325ULL ^ (uint64_t)n) * 0x100000001b3ULL ^ (uint64_t)ign;
    for (int64_t i = 0; i < n; i++) h = (h ^ (uint64_t)t[i]) * 0x100000001b3ULL;
    h ^= h >> 29;
    double ref[2] = {(double)(h & 0xFFFFFF), -(double)(h & 0xFFFFFF)};
    float fp[2];
    float *dfp = dmem(8);
    ok("xent_targets_hash", K->xent_targets_hash(NULL, dfp, DPUTI(t, n), n, ign));
    GETF(fp, dfp, 2);
    expect("fp", fp, ref, 2, 0, 0, NULL);
  }
}

/* ----------------------------------------------------- embedding and cross-entropy */

static void case_embedding_forward(void) {
  const int64_t sz[][2] = {{0, 5}, {1, 1}, {9, 5}, {13, 33}};
  for (size_t c = 0; c < 4; c++) {
    int64_t M = sz[c][0], C = sz[c][1], V = 7, lo = 10, *tok = hmem((size_t)M * 8 + 8);
    for (int64_t m = 0; m < M; m++) tok[m] = rnd_int(5, 20); /* some outside the shard [10, 17) */
    float *table = rnd(V * C, -1, 1), *out = rnd(M * C, -1, 1);
    double *ref = dz(M * C + 1);
    for (int64_t m = 0; m < M; m++)
      for (int64_t j = 0; j < C; j++)
        ref[m * C + j] = tok[m] >= lo && tok[m] < lo + V ? table[(tok[m] - lo) * C + j] : 0;
    float *dout = DPUTF(out, M * C);
    ok("embedding_forward", K->embedding_forward(NULL, dout, DPUTI(tok, M), DPUTF(table, V * C), M, lo, V, C));
    GETF(out, dout, M * C);
    expect("out", out, ref, M * C, 0, 0, NULL);
  }
}

static void case_embedding_backward(void) {
  /* 600 rows: CUDA's scans of the tokens take 256 at a time (first occurrence, then the repeats) */
  const int64_t sz[][2] = {{0, 5}, {1, 1}, {9, 5}, {40, 33}, {600, 3}};
  for (size_t c = 0; c < 5; c++) {
    int64_t M = sz[c][0], C = sz[c][1], V = 7, lo = 10, *tok = hmem((size_t)M * 8 + 8);
    for (int64_t m = 0; m < M; m++) tok[m] = rnd_int(5, 20); /* repeats: rows add up */
    float *dt = rnd(V * C, -1, 1), *dout = rnd(M * C, -1, 1);
    double *ref = dz(V * C + 1), *mag = dz(V * C + 1);
    for (int64_t i = 0; i < V * C; i++) ref[i] = dt[i], mag[i] = fabs(dt[i]);
    for (int64_t m = 0; m < M; m++)
      if (tok[m] >= lo && tok[m] < lo + V)
        for (int64_t j = 0; j < C; j++)
          ref[(tok[m] - lo) * C + j] += dout[m * C + j], mag[(tok[m] - lo) * C + j] += fabs(dout[m * C + j]);
    float *ddt = DPUTF(dt, V * C);
    ok("embedding_backward", K->embedding_backward(NULL, ddt, DPUTI(tok, M), DPUTF(dout, M * C), M, lo, V, C));
    GETF(dt, ddt, V * C);
    expect("dtable", dt, ref, V * C, 2 * (M + 2) * U, 0, mag);
  }
}

static const int64_t XS[][2] = {{0, 7}, {1, 1}, {5, 7}, {3, 300}, {67, 8009}, {2, 0}}; /* M, V */
#define NXS (sizeof XS / sizeof XS[0])

static void case_xent_row_max(void) {
  for (size_t c = 0; c < NXS; c++) {
    int64_t M = XS[c][0], V = XS[c][1];
    float *l = rnd(M * V, -8, 8), *mx = hmem((size_t)M * 4 + 4);
    double *ref = dz(M + 1);
    for (int64_t m = 0; m < M; m++) {
      ref[m] = -INFINITY;
      for (int64_t j = 0; j < V; j++) ref[m] = fmax(ref[m], l[m * V + j]);
    }
    float *dmx = dmem((size_t)M * 4);
    ok("xent_row_max", K->xent_row_max(NULL, dmx, DPUTF(l, M * V), M, V));
    GETF(mx, dmx, M);
    expect("rowmax", mx, ref, M, 0, 0, NULL);
  }
}

/* Rows of logits with their maxima (the shard's max plus a little: the global max of
 * another shard may be larger) and targets: ignored, in the shard, outside it. */
static void xent_inputs(int64_t M, int64_t V, int64_t lo, float **l, float **gmax, int64_t **t) {
  *l = rnd(M * V, -8, 8);
  *gmax = hmem((size_t)M * 4 + 4);
  *t = hmem((size_t)M * 8 + 8);
  for (int64_t m = 0; m < M; m++) {
    float mx = -INFINITY;
    for (int64_t j = 0; j < V; j++) mx = fmaxf(mx, (*l)[m * V + j]);
    (*gmax)[m] = (V ? mx : 0.0f) + (m % 2 ? 0.25f : 0.0f);
    int64_t r = rnd_int(0, 5);
    (*t)[m] = r == 0 ? -1 : r == 1 ? lo + V + 3 : lo + rnd_int(0, V ? V : 1);
  }
}

static void case_xent_row_sums(void) {
  for (size_t c = 0; c < NXS; c++) {
    int64_t M = XS[c][0], V = XS[c][1], lo = 4, *t;
    float *l, *gmax, *sums = hmem((size_t)M * 8 + 4);
    xent_inputs(M, V, lo, &l, &gmax, &t);
    double *ref = dz(2 * M + 1);
    for (int64_t m = 0; m < M; m++) {
      for (int64_t j = 0; j < V; j++) ref[m] += exp((double)l[m * V + j] - gmax[m]);
      ref[M + m] = t[m] >= lo && t[m] < lo + V ? l[m * V + t[m] - lo] : 0.0;
    }
    float *ds = dmem((size_t)M * 8);
    ok("xent_row_sums", K->xent_row_sums(NULL, ds, DPUTF(l, M * V), DPUTF(gmax, M), DPUTI(t, M), M, lo, V));
    GETF(sums, ds, 2 * M);
    /* terms in (0, 1]: fexp's ~1e-7 relative error each, float partial sums of 32 terms per
     * lane (<= 34 u), then double: 1e-6 relative is a 1.5x margin; target logits exact */
    expect("sums", sums, ref, M, 0, 1e-6, NULL);
    expect("target logits", sums + M, ref + M, M, 0, 0, NULL);
  }
}

static void case_xent_loss(void) {
  const int64_t ns[] = {0, 1, 9, 301};
  for (size_t c = 0; c < 4; c++) {
    int64_t M = ns[c], *t = hmem((size_t)M * 8 + 8);
    float *se = rnd(M, 1, 1000), *gm = rnd(M, -5, 5), *tl = rnd(M, -9, 5), *loss = hmem((size_t)M * 4 + 4);
    double *ref = dz(M + 1), *mag = dz(M + 1);
    for (int64_t m = 0; m < M; m++) {
      t[m] = rnd_int(-1, 3);
      ref[m] = t[m] < 0 ? 0 : log((double)se[m]) + gm[m] - tl[m];
      mag[m] = fabs(log((double)se[m])) + fabs(gm[m]) + fabs(tl[m]);
    }
    float *dl = dmem((size_t)M * 4);
    ok("xent_loss", K->xent_loss(NULL, dl, DPUTF(se, M), DPUTF(gm, M), DPUTF(tl, M), DPUTI(t, M), M));
    GETF(loss, dl, M);
    expect("losses", loss, ref, M, 2 * U, 0, mag); /* computed in double, rounded once */
  }
}

static void case_xent_row_scale(void) {
  const int64_t ns[] = {0, 1, 9, 301};
  for (size_t c = 0; c < 4; c++)
    for (int with_dloss = 0; with_dloss < 2; with_dloss++) {
      int64_t M = ns[c], *t = hmem((size_t)M * 8 + 8);
      float *dloss = rnd(M, -2, 2), *rs = hmem((size_t)M * 4 + 4);
      double *ref = dz(M + 1);
      for (int64_t m = 0; m < M; m++) {
        t[m] = rnd_int(-1, 3);
        ref[m] = t[m] < 0 ? 0 : with_dloss ? dloss[m] : 1.0;
      }
      float *drs = dmem((size_t)M * 4);
      ok("xent_row_scale", K->xent_row_scale(NULL, drs, DPUTI(t, M), with_dloss ? DPUTF(dloss, M) : NULL, M));
      GETF(rs, drs, M);
      expect("row_scale", rs, ref, M, 0, 0, NULL);
    }
}

static void case_xent_backward(void) {
  for (size_t c = 0; c < NXS; c++)
    for (int with_rs = 0; with_rs < 2; with_rs++) {
      int64_t M = XS[c][0], V = XS[c][1], lo = 4, *t;
      float *l, *gmax, scale = 0.37f;
      xent_inputs(M, V, lo, &l, &gmax, &t);
      float *se = hmem((size_t)M * 4 + 4), *rs = rnd(M, -2, 2), *d = hmem((size_t)(M * V) * 4 + 4);
      for (int64_t m = 0; m < M; m++) {
        double s = 0;
        for (int64_t j = 0; j < V; j++) s += exp((double)l[m * V + j] - gmax[m]);
        se[m] = (float)(s > 0 ? s * 1.5 : 1.0); /* a global sum: larger than the shard's */
      }
      double *ref = dz(M * V + 1), *mag = dz(M * V + 1);
      for (int64_t m = 0; m < M; m++) {
        double k = (with_rs ? rs[m] : 1.0) * scale;
        for (int64_t j = 0; j < V; j++) {
          double p = exp((double)l[m * V + j] - gmax[m]) / se[m];
          ref[m * V + j] = k * (p - (t[m] >= 0 && t[m] - lo == j));
          mag[m * V + j] = fabs(k);
        }
      }
      float *dd = dmem((size_t)(M * V) * 4);
      ok("xent_backward", K->xent_backward(NULL, dd, DPUTF(l, M * V), DPUTF(gmax, M), DPUTF(se, M), DPUTI(t, M),
                                           with_rs ? DPUTF(rs, M) : NULL, scale, M, lo, V));
      GETF(d, dd, M * V);
      /* exp(l - max) k with fexp (~1e-7) and three float roundings: 1e-6 relative; the
       * one-hot subtraction of |k| adds one rounding of |k| */
      expect("dlogits", d, ref, M * V, 2 * U, 1e-6, mag);
    }
}

/* ---------------------------------------------------------------------- optimizers */

static void case_adamw_step(void) {
  const int64_t ns[] = {0, 1, 7, 1031};
  for (size_t c = 0; c < 4; c++)
    for (int v2 = 0; v2 < 2; v2++) {
      int64_t n = ns[c], step = v2 ? 10 : 1;
      float lr = 0.01f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = v2 ? 0.1f : 0.0f;
      float *p = rnd(n, -1, 1), *g = rnd(n, -1, 1), *m = rnd(n, -0.1, 0.1), *v = rnd(n, 0, 0.01);
      double *rp = dz(n + 1), *rm = dz(n + 1), *rv = dz(n + 1), *mag = dz(n + 1), *mm = dz(n + 1), *mv = dz(n + 1);
      double bc1 = 1 - pow(b1, (double)step), bc2 = 1 - pow(b2, (double)step);
      for (int64_t i = 0; i < n; i++) {
        rm[i] = b1 * (double)m[i] + (1 - (double)b1) * g[i];
        rv[i] = b2 * (double)v[i] + (1 - (double)b2) * g[i] * (double)g[i];
        mm[i] = fabs(b1 * (double)m[i]) + fabs((1 - (double)b1) * g[i]), mv[i] = rv[i];
        double upd = (rm[i] / bc1) / (sqrt(rv[i] / bc2) + eps);
        rp[i] = (double)p[i] * (1 - (double)lr * wd) - (double)lr * upd;
        mag[i] = fabs(p[i]) + lr * fabs(upd);
      }
      float *dp = DPUTF(p, n), *dm = DPUTF(m, n), *dv = DPUTF(v, n);
      ok("adamw_step", K->adamw_step(NULL, dp, DPUTF(g, n), dm, dv, n, lr, b1, b2, eps, wd, step));
      GETF(p, dp, n), GETF(m, dm, n), GETF(v, dv, n);
      /* a few float operations each (1 - beta in float is off by up to u / (1 - beta) relative:
       * 16 u of the terms' magnitudes) */
      expect("m", m, rm, n, 16 * U, 0, mm);
      expect("v", v, rv, n, 16 * U, 0, mv);
      expect("p", p, rp, n, 16 * U, 0, mag);
    }
}

static void case_sgd_step(void) {
  const int64_t ns[] = {0, 1, 7, 1031};
  for (size_t c = 0; c < 4; c++)
    for (int mode = 0; mode < 3; mode++) { /* no momentum; first step; later step */
      int64_t n = ns[c];
      float lr = 0.05f, mom = 0.9f, wd = 0.01f;
      float *p = rnd(n, -1, 1), *g = rnd(n, -1, 1), *buf = rnd(n, -1, 1);
      double *rp = dz(n + 1), *rb = dz(n + 1), *mag = dz(n + 1), *mb = dz(n + 1);
      for (int64_t i = 0; i < n; i++) {
        double gi = g[i] + (double)wd * p[i];
        if (mode) gi = mode == 1 ? gi : mom * (double)buf[i] + gi;
        rb[i] = gi;
        mb[i] = fabs(g[i]) + fabs(wd * p[i]) + (mode == 2 ? fabs(mom * buf[i]) : 0);
        rp[i] = p[i] - (double)lr * gi;
        mag[i] = fabs(p[i]) + lr * (fabs(g[i]) + fabs(mom * buf[i]) + 1);
      }
      float *dp = DPUTF(p, n), *db = mode ? DPUTF(buf, n) : NULL;
      ok("sgd_step", K->sgd_step(NULL, dp, DPUTF(g, n), db, n, lr, mom, wd, mode == 1));
      GETF(p, dp, n);
      expect("p", p, rp, n, 8 * U, 0, mag);
      if (db) {
        GETF(buf, db, n);
        expect("buf", buf, rb, n, 8 * U, 0, mb);
      }
    }
}

/* --------------------------------------------------------------------------- main */

typedef struct {
  const char *entry;
  void (*run)(void);
} parity_case;

static const parity_case cases[] = {
    {"gemm", case_gemm},
    {"linear_forward", case_linear_forward},
    {"linear_backward", case_linear_backward},
    {"add_bias", case_add_bias},
    {"bias_grad", case_bias_grad},
    {"act_forward", case_act_forward},
    {"act_backward", case_act_backward},
    {"bias_act_forward", case_bias_act_forward},
    {"bias_act_backward_workspace", case_bias_act_backward_workspace},
    {"bias_act_backward", case_bias_act_backward},
    {"layernorm_forward", case_layernorm_forward},
    {"layernorm_backward", case_layernorm_backward},
    {"rmsnorm_forward", case_rmsnorm_forward},
    {"rmsnorm_backward", case_rmsnorm_backward},
    {"rope", case_rope},
    {"attention_workspace", case_attention_workspace},
    {"attention_forward", case_attention_forward},
    {"attention_backward", case_attention_backward},
    {"kv_cache_write", case_kv_cache_write},
    {"kv_cache_write_paged", case_kv_cache_write_paged},
    {"positions", case_positions},
    {"embedding_forward", case_embedding_forward},
    {"embedding_backward", case_embedding_backward},
    {"xent_row_max", case_xent_row_max},
    {"xent_row_sums", case_xent_row_sums},
    {"xent_loss", case_xent_loss},
    {"xent_row_scale", case_xent_row_scale},
    {"xent_backward", case_xent_backward},
    {"xent_targets", case_xent_targets},
    {"xent_targets_hash", case_xent_targets_hash},
    {"check_range", case_check_range},
    {"add", case_add},
    {"sub", case_sub},
    {"scale", case_scale},
    {"fill", case_fill},
    {"init_uniform", case_init_uniform},
    {"init_normal", case_init_normal},
    {"adamw_step", case_adamw_step},
    {"sgd_step", case_sgd_step},
    {"convert", case_convert},
    {"linear_lp_workspace", case_linear_lp_workspace},
    {"linear_forward_lp", case_linear_forward_lp},
    {"linear_backward_lp", case_linear_backward_lp},
    {"embedding_forward_lp", case_embedding_forward_lp},
};

/* Extra cases of an entry (test_kernels_qlp.c): the quantized weight formats, on the
 * tables that take them (quant_table); printed as "<table> quant_<entry>: ok". */
static const parity_case quant_cases[] = {
    {"linear_lp_workspace", case_quant_linear_lp_workspace},
    {"linear_forward_lp", case_quant_linear_forward_lp},
    {"linear_backward_lp", case_quant_linear_backward_lp},
    {"embedding_forward_lp", case_quant_embedding_forward_lp},
};

void run_api_tests(int *passed, int *failed);   /* test_kernels_api.c */
void run_quant_tests(int *passed, int *failed); /* test_kernels_quant.c */

#define ENTRY_NAME_(n) #n,
static const char *const entries[] = {TP_KERNEL_ENTRIES(ENTRY_NAME_)};

static int entry_is_set(const tp_kernel_ops *k, const char *name) {
#define ENTRY_SET_(n) \
  if (!strcmp(name, #n)) return k->n != NULL;
  TP_KERNEL_ENTRIES(ENTRY_SET_)
#undef ENTRY_SET_
  return 0;
}

/* Loading the CUDA plugin registers the CUDA tables; on a machine without a GPU
 * tp_kernels_of(TP_DEVICE_CUDA) stays NULL and the CPU's cases run alone. */

int main(int argc, char **argv) {
  const char *only = argc > 1 ? argv[1] : NULL; /* one entry, for debugging */
  int passed = 0, failed = 0;
  if (tp_cuda_load(NULL) != TP_SUCCESS) printf("cuda plugin: not loaded (%s)\n", tp_last_error());
  printf("entries:");
  for (size_t i = 0; i < TP_KERNEL_NUM_ENTRIES; i++) printf(" %s", entries[i]);
  printf("\ncovered:");
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) printf(" %s", cases[i].entry);
  printf("\n");
  for (size_t i = 0; i < TP_KERNEL_NUM_ENTRIES; i++) { /* an entry without a case fails */
    int found = 0;
    for (size_t j = 0; j < sizeof cases / sizeof cases[0]; j++) found |= !strcmp(entries[i], cases[j].entry);
    if (!found) printf("entry %s: FAIL (no parity case)\n", entries[i]), failed++;
  }
  for (int d = 0; d < TP_NUM_DEVICE_TYPES; d++) {
    K = tp_kernels_of((tp_device_t)d);
    DEV = (tp_device_t)d;
    if (!K) {
      printf("device %s: no kernel table in this build or process (skipped)\n", tp_device_name(DEV));
      continue;
    }
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
      if (only && strcmp(only, cases[i].entry)) continue;
      case_failed = 0, worst = 0;
      if (!entry_is_set(K, cases[i].entry)) fail("the table has no %s", cases[i].entry);
      else cases[i].run();
      release();
      printf("%s %s: %s (worst |err|/tol %.3f)\n", K->name, cases[i].entry, case_failed ? "FAIL" : "ok", worst);
      case_failed ? failed++ : passed++;
    }
    for (size_t i = 0; quant_table(K) && i < sizeof quant_cases / sizeof quant_cases[0]; i++) {
      if (only && strcmp(only, quant_cases[i].entry)) continue;
      case_failed = 0, worst = 0;
      quant_cases[i].run();
      release();
      printf("%s quant_%s: %s (worst |err|/tol %.3f)\n", K->name, quant_cases[i].entry, case_failed ? "FAIL" : "ok",
             worst);
      case_failed ? failed++ : passed++;
    }
  }
  if (!only) run_api_tests(&passed, &failed);
  if (!only || !strcmp(only, "quant")) run_quant_tests(&passed, &failed);
  release();
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
