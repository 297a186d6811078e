/*
 * C-level test of the parallel MLP (column fc1 -> GELU -> row fc2), without
 * Python: world sizes 1-3, forward and input gradient against a double
 * reference computed here from the same deterministic full weights, which each
 * rank writes into its own shard.  Prints "N passed, N failed".
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tpcore/layers.h"

enum { H = 7, F = 11, R = 5 };

static double w1(int i, int j) { return sin(0.37 * i + 0.11 * j + 0.5) * 0.4; }  /* W1 [F][H] */
static double b1(int i) { return cos(0.7 * i) * 0.3; }
static double w2(int i, int j) { return cos(0.23 * i - 0.19 * j + 0.1) * 0.4; }  /* W2 [H][F] */
static double b2(int i) { return sin(0.9 * i) * 0.2; }
static double xin(int m, int j) { return sin(1.3 * m + 0.7 * j) + 0.1; }
static double dyv(int m, int j) { return cos(0.5 * m - 0.3 * j); }
static double gelu(double v) { return 0.5 * v * (1 + erf(v / sqrt(2))); }
static double dgelu(double v) { return 0.5 * (1 + erf(v / sqrt(2))) + v * exp(-0.5 * v * v) / sqrt(2 * M_PI); }

static int run_rank(int n, int r, const char *job) {
  tp_comm_config_t cc = TP_COMM_CONFIG_INITIALIZER;
  cc.job_id = job;
  cc.timeout_s = 30;
  tp_comm_t comm;
  if (tp_comm_init_rank(&comm, n, r, &cc) != TP_SUCCESS) return fprintf(stderr, "init: %s\n", tp_last_error()), 1;
  tp_mlp_config_t cfg = TP_MLP_CONFIG_INITIALIZER;
  cfg.hidden = H;
  cfg.ffn_hidden = F;
  cfg.activation = TP_ACT_GELU;
  tp_parallel_mlp_t mlp;
  if (tp_parallel_mlp_create(&mlp, comm, &cfg) != TP_SUCCESS) return fprintf(stderr, "mlp: %s\n", tp_last_error()), 1;
  tp_linear_info_t i1, i2;
  tp_parallel_linear_info(tp_parallel_mlp_layer(mlp, 0), &i1);
  tp_parallel_linear_info(tp_parallel_mlp_layer(mlp, 1), &i2);
  for (int i = 0; i < i1.local; i++) {  /* fc1: rows [offset, offset + local) of W1 */
    for (int j = 0; j < H; j++) i1.weight[i * H + j] = (float)w1((int)i1.offset + i, j);
    i1.bias[i] = (float)b1((int)i1.offset + i);
  }
  for (int i = 0; i < H; i++) {  /* fc2: columns [offset, offset + local) of W2 */
    for (int j = 0; j < i2.local; j++) i2.weight[i * i2.local + j] = (float)w2(i, (int)i2.offset + j);
    i2.bias[i] = (float)b2(i);
  }
  float x[R * H], y[R * H], dy[R * H], dx[R * H];
  for (int m = 0; m < R; m++)
    for (int j = 0; j < H; j++) x[m * H + j] = (float)xin(m, j), dy[m * H + j] = (float)dyv(m, j);
  int bad = 0;
  for (int step = 0; step < 2; step++) { /* the second step reuses the workspaces */
    if (tp_parallel_mlp_forward(mlp, y, x, R) != TP_SUCCESS || tp_parallel_mlp_backward(mlp, dx, dy, R) != TP_SUCCESS)
      return fprintf(stderr, "step: %s\n", tp_last_error()), 1;
    for (int m = 0; m < R; m++) {
      double h[F], a[F], da[F];
      for (int f = 0; f < F; f++) {
        h[f] = b1(f);
        for (int j = 0; j < H; j++) h[f] += xin(m, j) * w1(f, j);
        a[f] = gelu(h[f]);
        da[f] = 0;
        for (int o = 0; o < H; o++) da[f] += dyv(m, o) * w2(o, f);
      }
      for (int o = 0; o < H; o++) {
        double ref = b2(o), gref = 0;
        for (int f = 0; f < F; f++) ref += a[f] * w2(o, f), gref += da[f] * dgelu(h[f]) * w1(f, o);
        if (fabs(y[m * H + o] - ref) > 1e-5 * (1 + fabs(ref))) bad++;
        if (fabs(dx[m * H + o] - gref) > 1e-5 * (1 + fabs(gref))) bad++;
      }
    }
  }
  tp_parallel_mlp_destroy(mlp);
  tp_comm_destroy(comm);
  if (bad) fprintf(stderr, "rank %d of %d: %d values off\n", r, n, bad);
  return bad ? 1 : 0;
}

int main(void) {
  int passed = 0, failed = 0;
  for (int n = 1; n <= 3; n++) {
    char job[64];
    snprintf(job, sizeof job, "clayers%d_%d", (int)getpid(), n);
    pid_t pids[3];
    for (int r = 0; r < n; r++)
      if ((pids[r] = fork()) == 0) {
        alarm(60);
        _exit(run_rank(n, r, job));
      }
    int ok = 1;
    for (int r = 0; r < n; r++) {
      int st;
      waitpid(pids[r], &st, 0);
      ok &= WIFEXITED(st) && WEXITSTATUS(st) == 0;
    }
    printf("parallel MLP (gelu) world %d: %s\n", n, ok ? "ok" : "FAILED");
    ok ? passed++ : failed++;
  }
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
