/* Parity cases of the neural-network entries: linear, activations, norms, RoPE and
 * attention (test_kernels.h has the tolerance rules). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "test_kernels.h"

/* ----------------------------------------------------------------------- linear */

/* M, K, N: empty, single, the GEMV path (M <= 2), K = 0, odd and larger than a block */
static const int64_t LS[][3] = {{0, 3, 4}, {1, 5, 3}, {2, 7, 5}, {3, 1, 1}, {5, 0, 4}, {13, 37, 19}, {70, 65, 33}};
#define NLS (sizeof LS / sizeof LS[0])

void case_linear_forward(void) {
  for (size_t c = 0; c < NLS; c++)
    for (int bias = 0; bias < 2; bias++) {
      int64_t M = LS[c][0], Kd = LS[c][1], N = LS[c][2];
      float *x = rnd(M * Kd, -1, 1), *w = rnd(N * Kd, -1, 1), *b = rnd(N, -1, 1), *y = rnd(M * N, -1, 1);
      double *ref = dz(M * N + 1), *mag = dz(M * N + 1);
      for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
          double s = bias ? b[n] : 0, a = fabs(s);
          for (int64_t k = 0; k < Kd; k++)
            s += (double)x[m * Kd + k] * w[n * Kd + k], a += fabs(x[m * Kd + k] * w[n * Kd + k]);
          ref[m * N + n] = s, mag[m * N + n] = a;
        }
      float *dy = DPUTF(y, M * N); /* y holds garbage: it must be overwritten */
      ok("linear_forward",
         K->linear_forward(NULL, dy, DPUTF(x, M * Kd), DPUTF(w, N * Kd), bias ? DPUTF(b, N) : NULL, M, Kd, N));
      GETF(y, dy, M * N);
      expect("y", y, ref, M * N, 2 * (Kd + 3) * U, 0, mag);
    }
}

void case_linear_backward(void) {
  for (size_t c = 0; c < NLS; c++)
    for (int mode = 0; mode < 4; mode++) { /* bit 0: accumulate_dx; bit 1: no dx, no db, no dw */
      int64_t M = LS[c][0], Kd = LS[c][1], N = LS[c][2];
      int acc = mode & 1, skip = mode >> 1;
      float *dy = rnd(M * N, -1, 1), *x = rnd(M * Kd, -1, 1), *w = rnd(N * Kd, -1, 1);
      float *dx = rnd(M * Kd, -1, 1), *dw = rnd(N * Kd, -1, 1), *db = rnd(N, -1, 1);
      double *rdx = dz(M * Kd + 1), *mdx = dz(M * Kd + 1), *rdw = dz(N * Kd + 1), *mdw = dz(N * Kd + 1);
      double *rdb = dz(N + 1), *mdb = dz(N + 1);
      for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < Kd; k++) {
          double s = acc ? dx[m * Kd + k] : 0, a = fabs(s);
          for (int64_t n = 0; n < N; n++)
            s += (double)dy[m * N + n] * w[n * Kd + k], a += fabs(dy[m * N + n] * w[n * Kd + k]);
          rdx[m * Kd + k] = s, mdx[m * Kd + k] = a;
        }
      for (int64_t n = 0; n < N; n++) {
        rdb[n] = db[n], mdb[n] = fabs(db[n]);
        for (int64_t m = 0; m < M; m++) rdb[n] += dy[m * N + n], mdb[n] += fabs(dy[m * N + n]);
        for (int64_t k = 0; k < Kd; k++) {
          double s = dw[n * Kd + k], a = fabs(s);
          for (int64_t m = 0; m < M; m++)
            s += (double)dy[m * N + n] * x[m * Kd + k], a += fabs(dy[m * N + n] * x[m * Kd + k]);
          rdw[n * Kd + k] = s, mdw[n * Kd + k] = a;
        }
      }
      float *ddx = DPUTF(dx, M * Kd), *ddw = DPUTF(dw, N * Kd), *ddb = DPUTF(db, N);
      ok("linear_backward", K->linear_backward(NULL, skip ? NULL : ddx, skip ? NULL : ddw, skip ? NULL : ddb,
                                               DPUTF(dy, M * N), DPUTF(x, M * Kd), DPUTF(w, N * Kd), M, Kd, N, acc));
      if (skip) continue;
      GETF(dx, ddx, M * Kd), GETF(dw, ddw, N * Kd), GETF(db, ddb, N);
      expect("dx", dx, rdx, M * Kd, 2 * (N + 3) * U, 0, mdx);
      expect("dw", dw, rdw, N * Kd, 2 * (M + 3) * U, 0, mdw);
      expect("db", db, rdb, N, 2 * (M + 3) * U, 0, mdb);
    }
}

/* ------------------------------------------------------------------ activations */

static const int64_t AS[][2] = {{0, 3}, {1, 1}, {3, 17}, {5, 33}, {515, 1031}}; /* the last splits over threads */
#define NAS (sizeof AS / sizeof AS[0])

static double phi(double x) { return exp(-0.5 * x * x) / sqrt(2 * M_PI); }
static double sigm(double x) { return 1 / (1 + exp(-x)); }

/* act(x) and act'(x) for the element-wise activations (of the gate for SwiGLU and GeGLU) */
static void act_ref(tp_activation_t a, double x, double *f, double *df) {
  const double c = sqrt(2 / M_PI);
  switch (a) {
    case TP_ACT_GELU: *f = 0.5 * x * (1 + erf(x / sqrt(2))), *df = 0.5 * (1 + erf(x / sqrt(2))) + x * phi(x); break;
    case TP_ACT_GELU_TANH:
    case TP_ACT_GEGLU: {
      double t = tanh(c * (x + 0.044715 * x * x * x));
      *f = 0.5 * x * (1 + t), *df = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x);
      break;
    }
    case TP_ACT_SILU:
    case TP_ACT_SWIGLU: *f = x * sigm(x), *df = sigm(x) * (1 + x * (1 - sigm(x))); break;
    case TP_ACT_RELU: *f = x > 0 ? x : 0, *df = x > 0; break;
  }
}

/* out[M,F] and dh[M,hw] references from h (+ b) and dout; mag: the tolerance scale of each
 * element: the approximations' errors (erf 1.5e-7 absolute, exp 1e-7 relative) times the
 * factors around them, |x| <= 5 and |dout| <= 1 -> 2e-6 (1 + |x|) per unit of |dout|. */
static void act_refs(tp_activation_t a, const float *h, const float *b, const float *dout, int64_t M, int64_t F,
                     double *out, double *mo, double *dh, double *mdh) {
  int64_t hw = tp_act_gated((tp_activation_t)a) ? 2 * F : F;
  for (int64_t m = 0; m < M; m++)
    for (int64_t j = 0; j < F; j++) {
      double d = dout ? dout[m * F + j] : 0, f, df;
      if (tp_act_gated(a)) {
        double g = (double)h[m * hw + j] + (b ? b[j] : 0), u = (double)h[m * hw + F + j] + (b ? b[F + j] : 0);
        if (b) g = (float)g, u = (float)u; /* the kernel adds the bias in float */
        act_ref(a, g, &f, &df);
        out[m * F + j] = f * u, mo[m * F + j] = (1 + fabs(g)) * (1 + fabs(u));
        dh[m * hw + F + j] = d * f, mdh[m * hw + F + j] = fabs(d) * (1 + fabs(g));
        dh[m * hw + j] = d * u * df, mdh[m * hw + j] = fabs(d) * (1 + fabs(u)) * (1 + fabs(g));
      } else {
        double x = (double)h[m * hw + j] + (b ? b[j] : 0);
        if (b) x = (float)x;
        act_ref(a, x, &f, &df);
        out[m * F + j] = f, mo[m * F + j] = 1 + fabs(x);
        dh[m * hw + j] = d * df, mdh[m * hw + j] = fabs(d) * (1 + fabs(x));
      }
    }
}

static void act_case(int backward, int fused) {
  for (int a = TP_ACT_GELU; a <= TP_ACT_LAST; a++)
    for (size_t c = 0; c < NAS; c++)
      for (int bias = 0; bias < 1 + fused; bias++) {
        int64_t M = AS[c][0], F = AS[c][1], hw = tp_act_gated((tp_activation_t)a) ? 2 * F : F;
        float *h = rnd(M * hw, -5, 5), *b = bias ? rnd(hw, -0.5, 0.5) : NULL, *dout = rnd(M * F, -1, 1);
        double *ro = dz(M * F + 1), *mo = dz(M * F + 1), *rdh = dz(M * hw + 1), *mdh = dz(M * hw + 1);
        act_refs((tp_activation_t)a, h, b, dout, M, F, ro, mo, rdh, mdh);
        float *dh_ = DPUTF(h, M * hw), *ddo = DPUTF(dout, M * F);
        float *got = hmem((size_t)(M * hw) * 4 + 4), *dres = dmem((size_t)(M * hw) * 4);
        if (!backward) {
          ok("act", fused ? K->bias_act_forward(NULL, dres, dh_, b ? DPUTF(b, hw) : NULL, M, F, (tp_activation_t)a)
                          : K->act_forward(NULL, dres, dh_, M, F, (tp_activation_t)a));
          GETF(got, dres, M * F);
          expect("out", got, ro, M * F, 2e-6, 1e-6, mo);
          if (fused) { /* h += b, in place: one rounding */
            double *rh = dz(M * hw + 1);
            for (int64_t i = 0; i < M * hw; i++) rh[i] = (double)h[i] + (b ? b[i % hw] : 0);
            GETF(got, dh_, M * hw);
            expect("h", got, rh, M * hw, 0, U, NULL);
          }
        } else {
          ok("act_backward", K->act_backward(NULL, dres, dh_, ddo, M, F, (tp_activation_t)a));
          GETF(got, dres, M * hw);
          expect("dh", got, rdh, M * hw, 2e-6, 1e-6, mdh);
        }
      }
}

void case_act_forward(void) { act_case(0, 0); }
void case_act_backward(void) { act_case(1, 0); }
void case_bias_act_forward(void) { act_case(0, 1); }

void case_bias_act_backward_workspace(void) {
  for (int a = TP_ACT_GELU; a <= TP_ACT_LAST; a++)
    for (size_t c = 0; c < NAS; c++) {
      int64_t M = AS[c][0], F = AS[c][1], hw = tp_act_gated((tp_activation_t)a) ? 2 * F : F;
      size_t n = K->bias_act_backward_workspace(M, F, (tp_activation_t)a);
      if (M == 0 && n != 0) fail("M = 0 needs no workspace, got %zu bytes", n);
      if (M > 0 && (n < (size_t)hw * sizeof(float) || n % ((size_t)hw * sizeof(float))))
        fail("M = %lld, hw = %lld: %zu bytes is not whole rows of partial sums", (long long)M, (long long)hw, n);
    }
}

void case_bias_act_backward(void) {
  for (int a = TP_ACT_GELU; a <= TP_ACT_LAST; a++)
    for (size_t c = 0; c < NAS; c++)
      for (int mode = 0; mode < 3; mode++) { /* no db; db with the asked workspace; db with one row */
        int64_t M = AS[c][0], F = AS[c][1], hw = tp_act_gated((tp_activation_t)a) ? 2 * F : F;
        float *h = rnd(M * hw, -5, 5), *dout = rnd(M * F, -1, 1), *db = rnd(hw, -1, 1);
        double *ro = dz(M * F + 1), *mo = dz(M * F + 1), *rdh = dz(M * hw + 1), *mdh = dz(M * hw + 1);
        double *rdb = dz(hw + 1), *mdb = dz(hw + 1);
        act_refs((tp_activation_t)a, h, NULL, dout, M, F, ro, mo, rdh, mdh);
        for (int64_t j = 0; j < hw; j++) {
          rdb[j] = db[j], mdb[j] = 1e-6 * fabs(db[j]) / 2e-6; /* in units of the dh tolerance */
          for (int64_t m = 0; m < M; m++) rdb[j] += rdh[m * hw + j], mdb[j] += mdh[m * hw + j] + fabs(rdh[m * hw + j]);
        }
        size_t need = mode ? K->bias_act_backward_workspace(M, F, (tp_activation_t)a) : 0;
        if (mode == 2 && M > 0) need = (size_t)hw * sizeof(float);
        void *ws = need ? dmem(need) : NULL;
        float *ddh = dmem((size_t)(M * hw) * 4), *ddb = DPUTF(db, hw), *got = hmem((size_t)((M + 1) * hw) * 4 + 4);
        ok("bias_act_backward", K->bias_act_backward(NULL, ddh, mode ? ddb : NULL, DPUTF(h, M * hw), DPUTF(dout, M * F),
                                                     M, F, (tp_activation_t)a, ws, need));
        GETF(got, ddh, M * hw);
        expect("dh", got, rdh, M * hw, 2e-6, 1e-6, mdh);
        if (mode) { /* a sum of M dh values: each within its tolerance, plus the summation's (M + 2) u */
          GETF(got, ddb, hw);
          for (int64_t j = 0; j < hw; j++) mdb[j] *= 1.0 + 2 * (M + 2) * U / 2e-6;
          expect("db", got, rdb, hw, 2e-6, 0, mdb);
        }
      }
}

/* ------------------------------------------------------------------------ norms */

static const int64_t NS[][2] = {{0, 4}, {1, 1}, {3, 7}, {5, 33}, {4, 257}};
#define NNS (sizeof NS / sizeof NS[0])

/* mean and rstd of each row in double (rms: mean 0, rstd from the mean of squares) */
static void stats(const float *x, int64_t M, int64_t C, int rms, double eps, double *mu, double *rs) {
  for (int64_t m = 0; m < M; m++) {
    double s = 0, ss = 0;
    for (int64_t c = 0; c < C; c++) s += x[m * C + c];
    mu[m] = rms ? 0 : s / C;
    for (int64_t c = 0; c < C; c++) ss += (x[m * C + c] - mu[m]) * (x[m * C + c] - mu[m]);
    rs[m] = 1 / sqrt(ss / C + eps);
  }
}

static void norm_forward_case(int rms) {
  for (size_t c = 0; c < NNS; c++)
    for (int opt = 0; opt < 2; opt++) { /* layernorm: bias and stats kept, or neither */
      int64_t M = NS[c][0], C = NS[c][1];
      float eps = 1e-5f, *x = rnd(M * C, 1, 5), *w = rnd(C, -1.5, 1.5), *b = rnd(C, -1, 1); /* mean ~3 */
      double *mu = dz(M + 1), *rs = dz(M + 1), *ry = dz(M * C + 1), *my = dz(M * C + 1);
      stats(x, M, C, rms, eps, mu, rs);
      for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < C; j++) {
          double xh = (x[m * C + j] - mu[m]) * rs[m];
          ry[m * C + j] = xh * w[j] + (!rms && opt ? b[j] : 0);
          /* float mean and rstd (one rounding each) and three float operations on values up to
           * |x| rstd |w| (rstd <= 1/sqrt(eps) for a constant row: C = 1) */
          my[m * C + j] = (fabs(x[m * C + j]) + fabs(mu[m])) * rs[m] * fabs(w[j]) + fabs(ry[m * C + j]);
        }
      float *dy = dmem((size_t)(M * C) * 4), *dmu = dmem((size_t)M * 4), *drs = dmem((size_t)M * 4);
      float *got = hmem((size_t)((M + 1) * C) * 4 + 4), *dx = DPUTF(x, M * C), *dw = DPUTF(w, C);
      if (rms) ok("rmsnorm_forward", K->rmsnorm_forward(NULL, dy, opt ? drs : NULL, dx, dw, M, C, eps));
      else
        ok("layernorm_forward", K->layernorm_forward(NULL, dy, opt ? dmu : NULL, opt ? drs : NULL, dx, dw,
                                                     opt ? DPUTF(b, C) : NULL, M, C, eps));
      GETF(got, dy, M * C);
      expect("y", got, ry, M * C, 8 * U, 0, my);
      if (!opt) continue;
      GETF(got, drs, M);
      expect("rstd", got, rs, M, 0, 4 * U, NULL);
      if (!rms) {
        GETF(got, dmu, M);
        expect("mean", got, mu, M, 0, 2 * U, NULL);
      }
    }
}

static void norm_backward_case(int rms) {
  for (size_t c = 0; c < NNS; c++)
    for (int with_db = 0; with_db < 2 - rms; with_db++) {
      int64_t M = NS[c][0], C = NS[c][1];
      float *x = rnd(M * C, -2, 2), *w = rnd(C, -1.5, 1.5), *dy = rnd(M * C, -1, 1);
      float *dw = rnd(C, -1, 1), *db = rnd(C, -1, 1), *mu = hmem((size_t)M * 4 + 4), *rs = hmem((size_t)M * 4 + 4);
      double *dmu = dz(M + 1), *drs = dz(M + 1);
      stats(x, M, C, rms, 1e-5, dmu, drs);
      for (int64_t m = 0; m < M; m++) mu[m] = (float)dmu[m], rs[m] = (float)drs[m]; /* the stats forward kept */
      double *rdx = dz(M * C + 1), *mdx = dz(M * C + 1), *rdw = dz(C + 1), *mdw = dz(C + 1), *rdb = dz(C + 1),
             *mdb = dz(C + 1);
      for (int64_t j = 0; j < C; j++) rdw[j] = dw[j], mdw[j] = fabs(dw[j]), rdb[j] = db[j], mdb[j] = fabs(db[j]);
      for (int64_t m = 0; m < M; m++) {
        double r = rs[m], sg = 0, sgx = 0, ag = 0;
        for (int64_t j = 0; j < C; j++) {
          double xh = (x[m * C + j] - (double)mu[m]) * r, g = (double)dy[m * C + j] * w[j];
          sg += g, sgx += g * (rms ? x[m * C + j] : xh), ag += fabs(g) * (1 + fabs(xh));
          rdw[j] += dy[m * C + j] * xh, mdw[j] += fabs(dy[m * C + j] * xh);
          rdb[j] += dy[m * C + j], mdb[j] += fabs(dy[m * C + j]);
        }
        for (int64_t j = 0; j < C; j++) {
          double xh = (x[m * C + j] - (double)mu[m]) * r, g = (double)dy[m * C + j] * w[j];
          rdx[m * C + j] = rms ? r * g - x[m * C + j] * r * r * r * sgx / C : r * (g - sg / C - xh * sgx / C);
          mdx[m * C + j] = r * (fabs(g) + (1 + fabs(xh)) * (1 + r * r * fabs(x[m * C + j])) * ag / C);
        }
      }
      float *ddx = dmem((size_t)(M * C) * 4), *ddw = DPUTF(dw, C), *ddb = DPUTF(db, C);
      float *got = hmem((size_t)((M + 1) * C) * 4 + 4);
      if (rms)
        ok("rmsnorm_backward",
           K->rmsnorm_backward(NULL, ddx, ddw, DPUTF(dy, M * C), DPUTF(x, M * C), DPUTF(w, C), DPUTF(rs, M), M, C));
      else
        ok("layernorm_backward", K->layernorm_backward(NULL, ddx, ddw, with_db ? ddb : NULL, DPUTF(dy, M * C),
                                                       DPUTF(x, M * C), DPUTF(w, C), DPUTF(mu, M), DPUTF(rs, M), M, C));
      /* row sums in double, then a few float operations per element: 16 u of the terms;
       * dw and db: a float sum of M terms, each a few roundings off */
      GETF(got, ddx, M * C);
      expect("dx", got, rdx, M * C, 16 * U, 0, mdx);
      GETF(got, ddw, C);
      expect("dw", got, rdw, C, (2 * M + 8) * U, 0, mdw);
      if (with_db) {
        GETF(got, ddb, C);
        expect("db", got, rdb, C, (2 * M + 4) * U, 0, mdb);
      }
    }
}

void case_layernorm_forward(void) { norm_forward_case(0); }
void case_layernorm_backward(void) { norm_backward_case(0); }
void case_rmsnorm_forward(void) { norm_forward_case(1); }
void case_rmsnorm_backward(void) { norm_backward_case(1); }

/* ------------------------------------------------------------------------- RoPE */

void case_rope(void) {
  const int64_t cfg[][4] = {
      {0, 1, 2, 0}, {1, 1, 2, 0}, {5, 3, 6, 5}, {9, 2, 8, 1}, {3, 4, 14, 3}}; /* rows heads D pad */
  for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++)
    for (int mode = 0; mode < 4; mode++) { /* inverse = mode & 1; mode >= 2: a table and a factor */
      int inv = mode & 1, tab = mode >= 2;
      int64_t R = cfg[c][0], H = cfg[c][1], D = cfg[c][2], ld = H * D + cfg[c][3], half = D / 2;
      float theta = 10000.0f, factor = tab ? 1.25f : 1.0f, *x = rnd(R * ld, -1, 1),
            *got = hmem((size_t)(R * ld) * 4 + 4);
      float *table = rnd(half + 1, 1e-4f, 1.0f); /* Llama 3 / YaRN tables: any positive frequencies */
      int64_t *pos = hmem((size_t)R * 8 + 8);
      double *ref = dz(R * ld + 1), *mag = dz(R * ld + 1);
      for (int64_t r = 0; r < R; r++) {
        pos[r] = rnd_int(0, 5000); /* far positions: the float32 angle of Hugging Face's rotary embedding */
        for (int64_t j = 0; j < ld; j++) ref[r * ld + j] = x[r * ld + j], mag[r * ld + j] = fabs(x[r * ld + j]);
        for (int64_t i = 0; i < half; i++) {
          float inv_freq = tab ? table[i] : (float)(1.0 / pow((double)theta, (double)(2 * i) / (double)D));
          float ang = (float)pos[r] * inv_freq; /* the angle is formed in float32 by definition */
          double cs = factor * cos((double)ang), sn = factor * (inv ? -sin((double)ang) : sin((double)ang));
          for (int64_t h = 0; h < H; h++) {
            double a = x[r * ld + h * D + i], b = x[r * ld + h * D + i + half];
            ref[r * ld + h * D + i] = a * cs - b * sn, ref[r * ld + h * D + i + half] = b * cs + a * sn;
            mag[r * ld + h * D + i] = mag[r * ld + h * D + i + half] = factor * (fabs(a) + fabs(b));
          }
        }
      }
      float *dx = DPUTF(x, R * ld);
      ok("rope",
         K->rope(NULL, dx, R, ld, H, D, DPUTI(pos, R), tab ? DPUTF(table, half + 1) : NULL, theta, factor, inv));
      GETF(got, dx, R * ld);
      expect("x", got, ref, R * ld, 5 * U, 0, mag); /* cos/sin rounded, times factor, two products and a sum */
    }
}
