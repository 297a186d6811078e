/* Parity cases of the low-precision weight entries: convert, linear_lp_workspace,
 * linear_forward_lp, linear_backward_lp, embedding_forward_lp (test_kernels.h has the
 * tolerance rules).
 *
 * The 16-bit references here are written from the definitions, not from bit tricks: a
 * value is rounded to the format's precision with rint() in double (ties to even; the
 * double holds every float32 exactly) and encoded with ldexp/ilogb.  The kernels' own
 * rounding (cpu/lowp.c) is integer arithmetic on the bits, so the two share no code. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "test_kernels.h"

/* ------------------------------------------------------------------ 16-bit formats */

typedef struct {
  tp_dtype_t dt;
  const char *name;
  int mbits, bias; /* stored mantissa bits; exponent bias (emin = 1 - bias) */
  double u;        /* unit roundoff 2^-(mbits + 1) */
} fmt16;

static const fmt16 BF16 = {TP_BFLOAT16, "bfloat16", 7, 127, 1.0 / 256};
static const fmt16 F16 = {TP_FLOAT16, "float16", 10, 15, 1.0 / 2048};

static float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

/* The value of a 16-bit pattern (NaN: a NaN of the pattern's sign). */
static double value16(const fmt16 *f, uint16_t h) {
  int sign = h >> 15, e = (h >> f->mbits) & ((1 << (15 - f->mbits)) - 1), emax_field = (1 << (15 - f->mbits)) - 1;
  uint32_t mant = h & ((1u << f->mbits) - 1);
  double v;
  if (e == emax_field) v = mant ? NAN : INFINITY;
  else if (e == 0) v = ldexp((double)mant, 1 - f->bias - f->mbits);
  else v = ldexp((double)(mant | (1u << f->mbits)), e - f->bias - f->mbits);
  return sign ? -v : v;
}

/* The 16-bit pattern of float value v rounded to nearest even (NaN: the canonical quiet NaN
 * of v's sign; the checks accept any quiet NaN of that sign). */
static uint16_t round16(const fmt16 *f, double v) {
  uint16_t sign = signbit(v) ? 0x8000 : 0, expmask = (uint16_t)(((1u << (15 - f->mbits)) - 1) << f->mbits);
  if (isnan(v)) return sign | expmask | (uint16_t)(1u << (f->mbits - 1));
  double a = fabs(v);
  int emin = 1 - f->bias, emax = f->bias;
  if (a == 0) return sign;
  int e = a == INFINITY ? emax + 1 : ilogb(a);
  if (e < emin) e = emin;
  double r = e > emax ? INFINITY : ldexp(rint(ldexp(a, f->mbits - e)), e - f->mbits); /* rint: ties to even */
  if (r >= ldexp(1.0, emax + 1)) return sign | expmask;                               /* overflow: infinity */
  if (r < ldexp(1.0, emin)) return sign | (uint16_t)ldexp(r, f->mbits - emin);        /* subnormal or zero */
  int re = ilogb(r);
  uint16_t mant = (uint16_t)(ldexp(r, f->mbits - re) - ldexp(1.0, f->mbits));
  return sign | (uint16_t)((re + f->bias) << f->mbits) | mant;
}

static int is_nan16(const fmt16 *f, uint16_t h) { return isnan(value16(f, h)); }
static int quiet16(const fmt16 *f, uint16_t h) { return (h >> (f->mbits - 1)) & 1; }

/* got == want bit for bit, except that a NaN may be any quiet NaN of the same sign. */
static int same16(const fmt16 *f, uint16_t got, uint16_t want) {
  if (is_nan16(f, want)) return is_nan16(f, got) && quiet16(f, got) && (got >> 15) == (want >> 15);
  return got == want;
}

/* A weight matrix in f: random values in [-1, 1) rounded, and their values. */
static uint16_t *rnd16(const fmt16 *f, int64_t n, double **val) {
  uint16_t *h = hmem((size_t)n * 2 + 2);
  double *v = dz(n + 1);
  for (int64_t i = 0; i < n; i++) {
    double x = -1 + 2 * (double)(rnd_u64() >> 11) / 9007199254740992.0;
    h[i] = round16(f, (float)x);
    v[i] = value16(f, h[i]);
  }
  *val = v;
  return h;
}

/* ------------------------------------------------------------------ convert */

/* Every 16-bit pattern widened to float32: exact (NaN: a NaN of the sign). */
static void convert_widen(const fmt16 *f) {
  int64_t n = 65536;
  uint16_t *h = hmem((size_t)n * 2);
  uint32_t *y = hmem((size_t)n * 4);
  for (int64_t i = 0; i < n; i++) h[i] = (uint16_t)i;
  void *dy = dmem((size_t)n * 4);
  ok("convert", K->convert(NULL, dy, TP_FLOAT32, dput(h, (size_t)n * 2), f->dt, n));
  dget(y, dy, (size_t)n * 4);
  for (int64_t i = 0; i < n; i++) {
    double want = value16(f, (uint16_t)i), got = bits_f32(y[i]);
    int good = isnan(want) ? isnan(got) && signbit(got) == signbit(want) : got == want && signbit(got) == signbit(want);
    if (!good) {
      fail("%s 0x%04llx -> float32: got 0x%08x (%.9g), want %.9g", f->name, (long long)i, (unsigned)y[i], got, want);
      return;
    }
  }
}

/* float32 inputs that probe the rounding: specials, each format's ties, overflow edges,
 * subnormals of both widths, and random bit patterns over every exponent. */
static uint32_t *probe_floats(int64_t n) {
  static const uint32_t special[] = {
      0x00000000, 0x80000000, 0x7f800000, 0xff800000, 0x7fc00000, 0xffc00000, 0x7fc12345, 0xffe00001, 0x7f800001,
      0x00000001, 0x807fffff, 0x00400000, 0x33000000, 0x33000001, 0x33800000, 0x387fc000, 0x387fe000, 0x38800000,
      0x477fe000, 0x477fefff, 0x477ff000, 0x477ff001, 0x47800000, 0xc77ff000, 0x7f7fffff, 0x7f7f7fff, 0x7f7f8000,
      0x7f7f8001, 0xff7f8000, 0x3f808000, 0x3f818000, 0x3f807fff, 0x3f800fff, 0x3f801000, 0x3f803000, 0x3f801001};
  uint32_t *u = hmem((size_t)n * 4);
  int64_t ns = (int64_t)(sizeof special / sizeof special[0]);
  for (int64_t i = 0; i < n; i++) {
    uint64_t r = rnd_u64();
    uint32_t s = (uint32_t)(r >> 32) & 0x80000000u;
    switch (i < ns ? 9 : (int)(r % 6)) {
      case 9: u[i] = special[i]; break;
      case 0: u[i] = (uint32_t)r; break; /* any pattern: NaNs, subnormals, huge, tiny */
      case 1:                            /* a bfloat16 tie: a 16-bit pattern and half its ulp */
        u[i] = ((uint32_t)(r >> 8) & 0xffff0000u) | 0x8000u;
        break;
      case 2: { /* a float16 tie (the midpoint of two neighbours, normal or subnormal) or a float32 step off it */
        uint16_t p = (uint16_t)((r >> 16) % 0x7c00);
        double tie = p == 0x7bff ? 65520.0 : (value16(&F16, p) + value16(&F16, (uint16_t)(p + 1))) / 2;
        float t = (float)tie; /* exact: 12 significant bits */
        int d = (int)((r >> 40) % 3);
        if (d) t = nextafterf(t, d == 1 ? 0.0f : INFINITY);
        u[i] = f32_bits(t) | s;
        break;
      }
      case 3: u[i] = s | (uint32_t)(0x33000000u + (r >> 8) % 0x05800000u); break; /* 2^-25 .. 2^-14: f16 subnormals */
      case 4: u[i] = s | (uint32_t)(0x477f0000u + (r >> 8) % 0x20000u); break;    /* around 65504 .. 65536 */
      default: u[i] = s | (uint32_t)(0x7f7f0000u + (r >> 8) % 0x10000u); break;   /* near float32's largest */
    }
  }
  return u;
}

static void convert_narrow(const fmt16 *f, const uint32_t *x, int64_t n) {
  uint16_t *y = hmem((size_t)n * 2);
  void *dy = dmem((size_t)n * 2);
  ok("convert", K->convert(NULL, dy, f->dt, dput(x, (size_t)n * 4), TP_FLOAT32, n));
  dget(y, dy, (size_t)n * 2);
  for (int64_t i = 0; i < n; i++) {
    uint16_t want = round16(f, bits_f32(x[i]));
    if (!same16(f, y[i], want)) {
      fail("float32 0x%08x (%.9g) -> %s: got 0x%04x, want 0x%04x", (unsigned)x[i], bits_f32(x[i]), f->name, y[i], want);
      return;
    }
  }
}

/* Every pattern of one 16-bit type to the other: one rounding of the exact value. */
static void convert_cross(const fmt16 *to, const fmt16 *from) {
  int64_t n = 65536;
  uint16_t *h = hmem((size_t)n * 2), *y = hmem((size_t)n * 2);
  for (int64_t i = 0; i < n; i++) h[i] = (uint16_t)i;
  void *dy = dmem((size_t)n * 2);
  ok("convert", K->convert(NULL, dy, to->dt, dput(h, (size_t)n * 2), from->dt, n));
  dget(y, dy, (size_t)n * 2);
  for (int64_t i = 0; i < n; i++) {
    uint16_t want = round16(to, value16(from, (uint16_t)i));
    if (!same16(to, y[i], want)) {
      fail("%s 0x%04llx -> %s: got 0x%04x, want 0x%04x", from->name, (long long)i, to->name, y[i], want);
      return;
    }
  }
}

void case_convert(void) {
  convert_widen(&BF16);
  convert_widen(&F16);
  const int64_t ns[] = {1, 37, 600001}; /* the last splits over threads */
  for (size_t c = 0; c < sizeof ns / sizeof ns[0]; c++) {
    uint32_t *x = probe_floats(ns[c]);
    convert_narrow(&BF16, x, ns[c]);
    convert_narrow(&F16, x, ns[c]);
  }
  convert_cross(&F16, &BF16);
  convert_cross(&BF16, &F16);
  /* the same dtype: a copy; n = 0: nothing is written */
  const tp_dtype_t dts[] = {TP_FLOAT32, TP_BFLOAT16, TP_FLOAT16};
  for (int d = 0; d < 3; d++) {
    size_t es = tp_dtype_size(dts[d]), n = 1001;
    unsigned char *x = hmem(n * es), *y = hmem(n * es);
    for (size_t i = 0; i < n * es; i++) x[i] = (unsigned char)rnd_u64();
    void *dy = dmem(n * es);
    ok("convert", K->convert(NULL, dy, dts[d], dput(x, n * es), dts[d], (int64_t)n));
    dget(y, dy, n * es);
    if (memcmp(x, y, n * es)) fail("convert %s -> %s is not a copy", tp_dtype_name(dts[d]), tp_dtype_name(dts[d]));
  }
  float sentinel = 42.0f, back = 0;
  float *ds = DPUTF(&sentinel, 1);
  ok("convert", K->convert(NULL, ds, TP_FLOAT32, dmem(2), TP_BFLOAT16, 0));
  GETF(&back, ds, 1);
  if (back != 42.0f) fail("convert with n = 0 wrote its output");
}

/* ------------------------------------------------------------------ linear */

/* M, K, N: empty, single, M = 1, 2 (decode), K = 1, K = 0, N odd; M = 9 with K = 8191 or
 * 40000 crosses the CPU table's panels of w (8 MiB of float32: 256 or 52 rows; M <= 8 takes
 * its GEMV path). */
static const int64_t LPS[][3] = {{0, 3, 4},    {1, 1, 1},      {1, 769, 131},   {2, 37, 65},   {3, 1, 5},
                                 {4, 250, 33}, {5, 0, 4},      {13, 37, 19},    {70, 65, 33},  {1, 0, 3},
                                 {1, 229, 77}, {9, 8191, 300}, {9, 40000, 110}, {3, 40000, 61}};
#define NLPS (sizeof LPS / sizeof LPS[0])

/* The tolerance per unit of sum |x||w|: float32 accumulation of K terms (test_kernels.h),
 * and when the table rounds activations to the weight type, that rounding (nrounded
 * operands per product, each within u_wdt relatively). */
static double lp_tol(const fmt16 *f, int64_t n, int nrounded) {
  return 2 * (double)(n + 3) * U + (K->lp_rounds_activations ? nrounded * 1.01 * f->u : 0);
}

static void *lp_workspace(int64_t M, int64_t Kd, int64_t N, const fmt16 *f, int backward, size_t *nbytes) {
  *nbytes = K->linear_lp_workspace(M, Kd, N, f->dt, backward);
  return *nbytes ? dmem(*nbytes) : NULL;
}

/* One forward on the device with a given workspace; y checked against the reference. */
static void forward_check(const fmt16 *f, int64_t M, int64_t Kd, int64_t N, const float *x, const uint16_t *w,
                          const float *b, const double *ref, const double *mag, void *ws, size_t wsb) {
  float *y = rnd(M * N, -1, 1), *dy = DPUTF(y, M * N); /* garbage: it must be overwritten */
  ok("linear_forward_lp", K->linear_forward_lp(NULL, dy, DPUTF(x, M * Kd), dput(w, (size_t)(N * Kd) * 2), f->dt,
                                               b ? DPUTF(b, N) : NULL, M, Kd, N, ws, wsb));
  GETF(y, dy, M * N);
  expect("y", y, ref, M * N, lp_tol(f, Kd, 1), 0, mag);
}

void case_linear_forward_lp(void) {
  const fmt16 *fs[] = {&BF16, &F16};
  for (size_t c = 0; c < NLPS; c++)
    for (int t = 0; t < 4; t++) { /* bit 0: bias; bit 1: float16 */
      const fmt16 *f = fs[t >> 1];
      int bias = t & 1;
      int64_t M = LPS[c][0], Kd = LPS[c][1], N = LPS[c][2];
      double *wv;
      uint16_t *w = rnd16(f, N * Kd, &wv);
      float *x = rnd(M * Kd, -1, 1), *b = bias ? rnd(N, -1, 1) : NULL;
      double *ref = dz(M * N + 1), *mag = dz(M * N + 1);
      for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
          double s = bias ? b[n] : 0, a = fabs(s);
          for (int64_t k = 0; k < Kd; k++)
            s += x[m * Kd + k] * wv[n * Kd + k], a += fabs(x[m * Kd + k] * wv[n * Kd + k]);
          ref[m * N + n] = s, mag[m * N + n] = a;
        }
      size_t wsb;
      void *ws = lp_workspace(M, Kd, N, f, 0, &wsb);
      forward_check(f, M, Kd, N, x, w, b, ref, mag, ws, wsb);
      if (!strcmp(K->name, "cpu") && Kd > 0 && M > 0) {
        /* the CPU table's documented smaller workspaces: 3 rows of panel, and none */
        forward_check(f, M, Kd, N, x, w, b, ref, mag, dmem((size_t)Kd * 12), (size_t)Kd * 12);
        forward_check(f, M, Kd, N, x, w, b, ref, mag, NULL, 0);
      }
    }
}

static void backward_check(const fmt16 *f, int64_t M, int64_t Kd, int64_t N, int mode, const float *dy, const float *x,
                           const uint16_t *w, const float *dx0, const float *dw0, const float *db0, const double *rdx,
                           const double *mdx, const double *rdw, const double *mdw, const double *rdb,
                           const double *mdb, void *ws, size_t wsb) {
  int acc = mode & 1, skip = mode >> 1;
  float *dx = hmem((size_t)(M * Kd) * 4 + 4), *dw = hmem((size_t)(N * Kd) * 4 + 4), *db = hmem((size_t)N * 4 + 4);
  float *ddx = DPUTF(dx0, M * Kd), *ddw = DPUTF(dw0, N * Kd), *ddb = DPUTF(db0, N);
  ok("linear_backward_lp",
     K->linear_backward_lp(NULL, skip ? NULL : ddx, skip ? NULL : ddw, skip ? NULL : ddb, DPUTF(dy, M * N),
                           DPUTF(x, M * Kd), dput(w, (size_t)(N * Kd) * 2), f->dt, M, Kd, N, acc, ws, wsb));
  GETF(dx, ddx, M * Kd), GETF(dw, ddw, N * Kd), GETF(db, ddb, N);
  if (skip) { /* nothing written */
    if (memcmp(dx, dx0, (size_t)(M * Kd) * 4) || memcmp(dw, dw0, (size_t)(N * Kd) * 4) ||
        memcmp(db, db0, (size_t)N * 4))
      fail("linear_backward_lp wrote an output that was NULL");
    return;
  }
  expect("dx", dx, rdx, M * Kd, lp_tol(f, N, 1), 0, mdx);
  expect("dw", dw, rdw, N * Kd, lp_tol(f, M, 2), 0, mdw); /* never reads w: float32 dy and x, or both rounded */
  expect("db", db, rdb, N, 2 * (M + 3) * U, 0, mdb);
}

void case_linear_backward_lp(void) {
  const fmt16 *fs[] = {&BF16, &F16};
  for (size_t c = 0; c < NLPS; c++)
    for (int t = 0; t < 6; t++) { /* mode (t % 3): 0 overwrite dx, 1 accumulate, 2 no dx/dw/db; t / 3: float16 */
      const fmt16 *f = fs[t / 3];
      int mode = t % 3 == 2 ? 2 : t % 3, acc = mode & 1;
      int64_t M = LPS[c][0], Kd = LPS[c][1], N = LPS[c][2];
      if (M * Kd * N > 20000000 && t % 3 != 0) continue; /* the large ones once per type */
      double *wv;
      uint16_t *w = rnd16(f, N * Kd, &wv);
      float *dy = rnd(M * N, -1, 1), *x = rnd(M * Kd, -1, 1);
      float *dx = rnd(M * Kd, -1, 1), *dw = rnd(N * Kd, -1, 1), *db = rnd(N, -1, 1);
      double *rdx = dz(M * Kd + 1), *mdx = dz(M * Kd + 1), *rdw = dz(N * Kd + 1), *mdw = dz(N * Kd + 1);
      double *rdb = dz(N + 1), *mdb = dz(N + 1);
      for (int64_t m = 0; m < M; m++) {
        double *r = rdx + m * Kd, *a = mdx + m * Kd;
        for (int64_t k = 0; k < Kd; k++) r[k] = acc ? dx[m * Kd + k] : 0, a[k] = fabs(r[k]);
        for (int64_t n = 0; n < N; n++) {
          double d = dy[m * N + n];
          const double *wr = wv + n * Kd;
          for (int64_t k = 0; k < Kd; k++) r[k] += d * wr[k], a[k] += fabs(d * wr[k]);
        }
      }
      for (int64_t n = 0; n < N; n++) {
        rdb[n] = db[n], mdb[n] = fabs(db[n]);
        for (int64_t m = 0; m < M; m++) rdb[n] += dy[m * N + n], mdb[n] += fabs(dy[m * N + n]);
        for (int64_t k = 0; k < Kd; k++) rdw[n * Kd + k] = dw[n * Kd + k], mdw[n * Kd + k] = fabs(dw[n * Kd + k]);
        for (int64_t m = 0; m < M; m++) {
          double d = dy[m * N + n];
          for (int64_t k = 0; k < Kd; k++)
            rdw[n * Kd + k] += d * x[m * Kd + k], mdw[n * Kd + k] += fabs(d * x[m * Kd + k]);
        }
      }
      size_t wsb;
      void *ws = lp_workspace(M, Kd, N, f, 1, &wsb);
      backward_check(f, M, Kd, N, mode, dy, x, w, dx, dw, db, rdx, mdx, rdw, mdw, rdb, mdb, ws, wsb);
      if (!strcmp(K->name, "cpu") && Kd > 0 && M > 0 && mode != 2) { /* 3 panel rows, and no workspace */
        backward_check(f, M, Kd, N, mode, dy, x, w, dx, dw, db, rdx, mdx, rdw, mdw, rdb, mdb, dmem((size_t)Kd * 12),
                       (size_t)Kd * 12);
        backward_check(f, M, Kd, N, mode, dy, x, w, dx, dw, db, rdx, mdx, rdw, mdw, rdb, mdb, NULL, 0);
      }
    }
}

/* The size is a function of its arguments, 0 for empty problems is allowed, and a large
 * weight never costs a float32 copy of itself (the point of storing it in 16 bits). */
void case_linear_lp_workspace(void) {
  const fmt16 *fs[] = {&BF16, &F16};
  for (int t = 0; t < 4; t++) {
    const fmt16 *f = fs[t >> 1];
    int bw = t & 1;
    for (size_t c = 0; c < NLPS; c++) {
      int64_t M = LPS[c][0], Kd = LPS[c][1], N = LPS[c][2];
      size_t a = K->linear_lp_workspace(M, Kd, N, f->dt, bw), b = K->linear_lp_workspace(M, Kd, N, f->dt, bw);
      if (a != b)
        fail("linear_lp_workspace(%lld, %lld, %lld) changed between calls", (long long)M, (long long)Kd, (long long)N);
    }
    int64_t M = 64, Kd = 8192, N = 32768;
    size_t nbytes = K->linear_lp_workspace(M, Kd, N, f->dt, bw);
    if (nbytes >= (size_t)(N * Kd) * 4)
      fail("linear_lp_workspace(%lld, %lld, %lld, %s, %d) = %zu: a float32 copy of w or more", (long long)M,
           (long long)Kd, (long long)N, f->name, bw, nbytes);
  }
}

/* ------------------------------------------------------------------ embedding */

void case_embedding_forward_lp(void) {
  const int64_t sz[][2] = {{0, 5}, {1, 1}, {9, 5}, {13, 33}, {40, 1027}};
  const fmt16 *fs[] = {&BF16, &F16};
  for (size_t c = 0; c < sizeof sz / sizeof sz[0]; c++)
    for (int t = 0; t < 2; t++) {
      const fmt16 *f = fs[t];
      int64_t M = sz[c][0], C = sz[c][1], V = 7, lo = 10, *tok = hmem((size_t)M * 8 + 8);
      for (int64_t m = 0; m < M; m++) tok[m] = rnd_int(5, 20); /* some outside the shard [10, 17) */
      if (M > 2) tok[0] = INT64_MIN, tok[1] = INT64_MAX;       /* far outside: no overflow in the range test */
      double *tv;
      uint16_t *table = rnd16(f, V * C, &tv);
      float *out = rnd(M * C, -1, 1);
      double *ref = dz(M * C + 1);
      for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < C; j++)
          ref[m * C + j] = tok[m] >= lo && tok[m] < lo + V ? tv[(tok[m] - lo) * C + j] : 0;
      float *dout = DPUTF(out, M * C);
      ok("embedding_forward_lp",
         K->embedding_forward_lp(NULL, dout, DPUTI(tok, M), dput(table, (size_t)(V * C) * 2), f->dt, M, lo, V, C));
      GETF(out, dout, M * C);
      expect("out", out, ref, M * C, 0, 0, NULL); /* widening is exact */
    }
}
