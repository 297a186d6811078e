/*
 * C-level test of the mpi backend (build/libtpcore_mpi.so, opened from beside the
 * program), run by `make test` under mpirun at world sizes 1..4.  Every rank checks
 * its results against references it computes itself from inputs every rank can
 * generate.  Exit status 0 = all passed; each rank prints "rank r: N failed".
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tpcore/comm.h"

static int g_fail, g_checks;

#define EXPECT(cond, ...)                                                    \
  do {                                                                       \
    g_checks++;                                                              \
    if (!(cond)) {                                                           \
      fprintf(stderr, "  rank check failed at %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                                          \
      fprintf(stderr, "\n");                                                 \
      g_fail++;                                                              \
    }                                                                        \
  } while (0)

#define OK(call)                                                                                                   \
  do {                                                                                                             \
    tp_status_t st_ = (call);                                                                                      \
    if (st_ != TP_SUCCESS) {                                                                                       \
      fprintf(stderr, "  %s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #call, tp_status_name(st_), tp_last_error()); \
      g_fail++;                                                                                                    \
      return;                                                                                                      \
    }                                                                                                              \
  } while (0)

/* Non-zero small value of element i on rank r (exact in every float type). */
static double val(int seed, int r, size_t i) {
  uint64_t x = (uint64_t)seed * 0x9E3779B97F4A7C15ULL + (uint64_t)r * 0xBF58476D1CE4E5B9ULL + i * 0x94D049BB133111EBULL;
  x ^= x >> 31;
  x *= 0xD6E8FEB86969D7DULL;
  x ^= x >> 29;
  int v = (int)(x % 15) - 7;
  return (v ? v : 3) / 4.0;
}

static void test_all_reduce(tp_comm_t c, int n, int r) {
  enum { N = 37 };
  float x[N], out[N];
  uint16_t h[N];
  for (int op = 0; op < TP_NUM_REDOPS; op++) {
    for (size_t i = 0; i < N; i++) x[i] = (float)val(op, r, i);
    for (size_t i = 0; i < N; i++) h[i] = tp_float_to_bf16((float)val(op, r, i));
    OK(tp_all_reduce(x, out, N, TP_FLOAT32, (tp_redop_t)op, c, NULL));
    OK(tp_all_reduce(h, h, N, TP_BFLOAT16, (tp_redop_t)op, c, NULL));
    for (size_t i = 0; i < N; i++) {
      double want = val(op, 0, i);
      for (int p = 1; p < n; p++) {
        double v = val(op, p, i);
        want = op == TP_PROD ? want * v : op == TP_MIN ? fmin(want, v) : op == TP_MAX ? fmax(want, v) : want + v;
      }
      if (op == TP_AVG) want /= n;
      EXPECT(fabs(out[i] - want) <= 1e-5 * fabs(want) + 1e-6, "float32 %s [%zu]: %g, want %g", tp_redop_name(op), i,
             out[i], want);
      EXPECT(fabs(tp_bf16_to_float(h[i]) - want) <= 2e-2 * fabs(want) + 1e-2, "bfloat16 %s [%zu]: %g, want %g",
             tp_redop_name(op), i, tp_bf16_to_float(h[i]), want);
    }
  }
  /* int64 avg accumulates in 128 bits: these sums overflow int64. */
  int64_t big[3] = {INT64_MAX - r, INT64_MIN + 2 * r, (int64_t)r - 5};
  OK(tp_all_reduce(big, big, 3, TP_INT64, TP_AVG, c, NULL));
  __int128 s0 = 0, s1 = 0, s2 = 0;
  for (int p = 0; p < n; p++) {
    s0 += INT64_MAX - p;
    s1 += INT64_MIN + 2 * (__int128)p;
    s2 += p - 5;
  }
  EXPECT(big[0] == (int64_t)(s0 / n) && big[1] == (int64_t)(s1 / n) && big[2] == (int64_t)(s2 / n),
         "int64 avg: %lld %lld %lld", (long long)big[0], (long long)big[1], (long long)big[2]);
}

static void test_gather_scatter(tp_comm_t c, int n, int r) {
  size_t counts[4] = {3, 0, 5, 1}, total = 0, before = 0;
  for (int p = 0; p < n; p++) total += counts[p];
  for (int p = 0; p < r; p++) before += counts[p];
  double mine[5], all[9], x[9];
  for (size_t i = 0; i < counts[r]; i++) mine[i] = val(50, r, i);
  OK(tp_all_gather_v(mine, all, counts, TP_FLOAT64, c, NULL));
  size_t k = 0;
  for (int p = 0; p < n; p++)
    for (size_t i = 0; i < counts[p]; i++, k++) EXPECT(all[k] == val(50, p, i), "all_gather_v [%zu]", k);
  /* reduce_scatter_v in place: out is this rank's block of x; the rest of x is left alone */
  for (size_t i = 0; i < total; i++) x[i] = val(60, r, i);
  OK(tp_reduce_scatter_v(x, x + before, counts, TP_FLOAT64, TP_SUM, c, NULL));
  for (size_t i = 0; i < total; i++) {
    double want = 0;
    for (int p = 0; p < n; p++) want += val(60, p, i);
    if (i >= before && i < before + counts[r]) EXPECT(fabs(x[i] - want) < 1e-12, "reduce_scatter_v [%zu]", i);
    else EXPECT(x[i] == val(60, r, i), "reduce_scatter_v changed x[%zu] outside this rank's block", i);
  }
  for (int root = 0; root < n; root++) {
    int8_t b[7];
    for (int i = 0; i < 7; i++) b[i] = (int8_t)(r == root ? 10 * root + i : -1);
    OK(tp_broadcast(b, b, 7, TP_INT8, root, c, NULL));
    for (int i = 0; i < 7; i++) EXPECT(b[i] == 10 * root + i, "broadcast from %d [%d] = %d", root, i, b[i]);
    int32_t y[4] = {r + 1, -r, 7, r * r}, out[4] = {0};
    OK(tp_reduce(y, out, 4, TP_INT32, TP_MAX, root, c, NULL));
    if (r == root) EXPECT(out[0] == n && out[1] == 0 && out[2] == 7 && out[3] == (n - 1) * (n - 1), "reduce max");
  }
  /* all_to_all: rank a sends rank b (a + 2b) % 4 elements (zeros included), val(70 + b, a, i) */
  size_t sc[4], rc[4], so = 0, ro = 0;
  double sx[16], ry[16];
  for (int p = 0; p < n; p++) sc[p] = (size_t)(r + 2 * p) % 4, rc[p] = (size_t)(p + 2 * r) % 4;
  for (int p = 0; p < n; p++)
    for (size_t i = 0; i < sc[p]; i++) sx[so++] = val(70 + p, r, i);
  OK(tp_all_to_all(sx, sc, ry, rc, TP_FLOAT64, c, NULL));
  for (int p = 0; p < n; p++)
    for (size_t i = 0; i < rc[p]; i++, ro++) EXPECT(ry[ro] == val(70 + r, p, i), "all_to_all from %d [%zu]", p, i);
  OK(tp_barrier(c, NULL));
}

static void test_p2p_split(tp_comm_t c, int n, int r) {
  float s[5], got[5];
  for (int i = 0; i < 5; i++) s[i] = (float)(100 * r + i);
  OK(tp_sendrecv(s, 5, (r + 1) % n, got, 5, (r + n - 1) % n, TP_FLOAT32, c, NULL));
  for (int i = 0; i < 5; i++) EXPECT(got[i] == (float)(100 * ((r + n - 1) % n) + i), "sendrecv ring [%d]", i);
  /* split: ranks 0..n-2 by parity; the last (of 3+) passes TP_SPLIT_NOCOLOR */
  int color = n >= 3 && r == n - 1 ? TP_SPLIT_NOCOLOR : r % 2;
  tp_comm_t sub = NULL;
  OK(tp_comm_split(c, color, r, &sub));
  if (color == TP_SPLIT_NOCOLOR) {
    EXPECT(sub == NULL, "NOCOLOR gives no communicator");
    return;
  }
  int members = 0, sr = -1, ss = -1;
  for (int p = 0; p < n; p++) members += !(n >= 3 && p == n - 1) && p % 2 == color;
  tp_comm_rank(sub, &sr);
  tp_comm_size(sub, &ss);
  EXPECT(ss == members && sr == r / 2, "split: rank %d of %d, want %d of %d", sr, ss, r / 2, members);
  double v = r;
  OK(tp_all_reduce(&v, &v, 1, TP_FLOAT64, TP_SUM, sub, NULL));
  double want = 0;
  for (int p = color; p < n - (n >= 3); p += 2) want += p;
  EXPECT(v == want, "split all_reduce %g, want %g", v, want);
  tp_comm_destroy(sub);
}

static void test_bad_uses(tp_comm_t c, int n, int r) {
  float x[4] = {0};
  tp_status_t st = tp_all_reduce(x, x, 4, TP_FLOAT32, TP_SUM, c, (tp_stream_t)1);
  EXPECT(st == TP_ERR_INVALID_ARGUMENT && strstr(tp_last_error(), "takes no stream"), "stream: %s", tp_last_error());
  if (n > 1) {
    st = tp_send(x, 4, TP_FLOAT32, r, c, NULL);
    EXPECT(st == TP_ERR_INVALID_ARGUMENT && strstr(tp_last_error(), "this rank itself"), "self send: %s",
           tp_last_error());
  }
  const char *b = NULL;
  tp_comm_backend(c, &b);
  EXPECT(b && !strcmp(b, "mpi"), "backend name %s", b ? b : "(null)");
}

int main(void) {
  const char *ws = getenv("OMPI_COMM_WORLD_SIZE"), *rs = getenv("OMPI_COMM_WORLD_RANK");
  int n = ws ? atoi(ws) : 1, r = rs ? atoi(rs) : 0;
  tp_comm_config_t cfg = TP_COMM_CONFIG_INITIALIZER;
  cfg.backend = "mpi";
  cfg.job_id = "ctest_mpi";
  cfg.timeout_s = 30;
  tp_comm_t c = NULL;
  /* a world that disagrees with mpirun's is refused */
  tp_status_t st = tp_comm_init_rank(&c, n + 1, r, &cfg);
  EXPECT(st == TP_ERR_MISMATCH && strstr(tp_last_error(), "MPI_COMM_WORLD has"), "wrong world: %s %s",
         tp_status_name(st), tp_last_error());
  st = tp_comm_init_rank(&c, n, r, &cfg);
  if (st != TP_SUCCESS) {
    fprintf(stderr, "rank %d: init: %s\n", r, tp_last_error());
    return 1;
  }
  test_all_reduce(c, n, r);
  test_gather_scatter(c, n, r);
  test_p2p_split(c, n, r);
  test_bad_uses(c, n, r);
  tp_comm_destroy(c);
  printf("test_mpi rank %d of %d: %d checks, %d failed\n", r, n, g_checks, g_fail);
  return g_fail != 0;
}
