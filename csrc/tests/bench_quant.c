/* Microbenchmark of the quantized dot kernels (cpu/quant.c): one thread, a GEMV y = W x over
 * SmolLM2-135M's shapes (K = 576, 1536; 512 for the K-quants, whose blocks are 256), each format, each ISA level this CPU runs.
 *   streamed: W ~ 96 MB, beyond the caches: the kernel at memory bandwidth (or not);
 *   cached:   W of 1536 rows (<= 2.2 MB), read again and again: the kernel's own speed;
 *   dequant:  tp_q_dequant_row of the cached rows (the GEMM path's panels, the embedding).
 * Prints ns per row and GB/s of weight bytes (K floats of x are not counted).  Then "model":
 * the decode GEMVs of all of SmolLM2-135M (30 layers of q, k, v, o, gate, up, down in Q4_1,
 * the tied 49152-row head in Q8_0, ~96 MB: llama.cpp's Q4_1 file) on 1 and 2 threads (rows
 * split, a barrier after each matrix), in ms per token: llama.cpp decodes the whole model in
 * about 10 ms per token on 2 threads here.  Not part of `make test`:
 *   make bench-quant  (build/bench_quant [format ...]) */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../kernels/cpu/quant_impl.h"

/* This thread's CPU time: on a shared machine, the time other processes take its core is
 * not counted (memory stalls are). */
static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

static uint64_t rng = 88172645463325252ULL;
static float frand(void) { /* xorshift64, uniform in [-1, 1) */
  rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
  return (float)((rng >> 40) * (2.0 / 16777216.0) - 1.0);
}

static volatile float sink;
static volatile uint64_t isink;

/* The read bandwidth one thread gets here: a plain sum over n bytes (GCC vectorizes it). */
static double read_gbs(const uint64_t *p, size_t n) {
  double best = 1e30;
  for (int r = 0; r < 3; r++) {
    double t0 = now();
    uint64_t s = 0;
    for (size_t i = 0; i < n / 8; i++) s += p[i];
    double t = now() - t0;
    isink = s;
    best = t < best ? t : best;
  }
  return n / best * 1e-9;
}

/* Seconds of the fastest of `reps` passes of y[n] = dot(W[n], x) over rows [0, N). */
static double gemv_time(tp_q_dot1_fn dot, const uint8_t *W, size_t rb, const float *x, int64_t K, int64_t N, float *y,
                        int reps) {
  double best = 1e30;
  for (int r = 0; r < reps; r++) {
    double t0 = now();
    for (int64_t n = 0; n < N; n++) y[n] = dot(W + (size_t)n * rb, x, K);
    double t = now() - t0;
    best = t < best ? t : best;
  }
  sink = y[N - 1];
  return best;
}

/* Seconds of the fastest of `reps` dequantizations of rows [0, N) (into one row of y). */
static double dequant_time(tp_dtype_t f, int isa, const uint8_t *W, size_t rb, int64_t K, int64_t N, float *y,
                           int reps) {
  double best = 1e30;
  for (int r = 0; r < reps; r++) {
    double t0 = now();
    for (int64_t n = 0; n < N; n++) tp_q_dequant_row_at(f, y, W + (size_t)n * rb, K, isa);
    double t = now() - t0;
    best = t < best ? t : best;
  }
  sink = y[K - 1];
  return best;
}

/* ------------------------------------------------------------------ the whole model's GEMVs */

typedef struct {
  tp_q_dot1_fn dot;
  const uint8_t *w;
  size_t rb;
  int64_t N, K;
  float *y;
} mat;

typedef struct {
  const mat *m;
  int nm, t, nt, reps;
  const float *x;
  pthread_barrier_t *bar;
} worker;

static void *model_worker(void *arg) {
  const worker *w = arg;
  for (int r = 0; r < w->reps; r++)
    for (int i = 0; i < w->nm; i++) {
      const mat *m = &w->m[i];
      int64_t lo = m->N * w->t / w->nt, hi = m->N * (w->t + 1) / w->nt;
      for (int64_t n = lo; n < hi; n++) m->y[n] = m->dot(m->w + (size_t)n * m->rb, w->x, m->K);
      pthread_barrier_wait(w->bar);
    }
  return NULL;
}

static void model_bench(void) {
  enum { LAYERS = 30, PER = 7, C = 576, F = 1536, KV = 192, V = 49152 };
  const int64_t shape[PER][2] = {{C, C}, {KV, C}, {KV, C}, {C, C}, {F, C}, {F, C}, {C, F}}; /* rows x K */
  mat m[LAYERS * PER + 1];
  int nm = 0;
  size_t total = 0;
  float *x = malloc(F * sizeof(float)), *src = malloc(F * sizeof(float)), *y = malloc(V * sizeof(float));
  for (int k = 0; k < F; k++) x[k] = frand();
  for (int l = 0; l < LAYERS * PER + 1; l++) {
    int head = l == LAYERS * PER;
    tp_dtype_t f = head ? TP_Q8_0 : TP_Q4_1;
    int64_t N = head ? V : shape[l % PER][0], K = head ? C : shape[l % PER][1];
    size_t rb;
    tp_weight_row_bytes(f, K, &rb);
    uint8_t *w = malloc((size_t)N * rb);
    for (int64_t n = 0; n < N; n++) {
      if (n < 64) {
        for (int64_t k = 0; k < K; k++) src[k] = frand();
        tp_q_quant_row(f, w + (size_t)n * rb, src, K);
      } else {
        memcpy(w + (size_t)n * rb, w + (size_t)(n % 64) * rb, rb);
      }
    }
    m[nm++] = (mat){tp_q_dot1_for(f), w, rb, N, K, y};
    total += (size_t)N * rb;
  }
  for (int nt = 1; nt <= 2; nt++) {
    enum { REPS = 5 };
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, (unsigned)nt);
    pthread_t th[2];
    worker wk[2];
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int t = 0; t < nt; t++) {
      wk[t] = (worker){m, nm, t, nt, REPS, x, &bar};
      pthread_create(&th[t], NULL, model_worker, &wk[t]);
    }
    for (int t = 0; t < nt; t++) pthread_join(th[t], NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double sec = (t1.tv_sec - t0.tv_sec + 1e-9 * (t1.tv_nsec - t0.tv_nsec)) / REPS;
    printf(
        "model: SmolLM2-135M decode GEMVs (%.1f MB of Q4_1 + Q8_0 weights), %d thread%s: %.2f ms/token, %.2f GB/s "
        "(wall clock: a loaded machine shows here)\n",
        total / 1048576.0, nt, nt > 1 ? "s" : "", 1e3 * sec, total / sec * 1e-9);
    pthread_barrier_destroy(&bar);
  }
  for (int i = 0; i < nm; i++) free((void *)m[i].w);
  free(x), free(src), free(y);
}

int main(int argc, char **argv) {
  static const tp_dtype_t fmts[] = {TP_Q4_1, TP_Q8_0, TP_Q4_K, TP_Q4_0, TP_Q5_K, TP_Q6_K, TP_INT8};
  static const char *isa_name[] = {"portable", "avx2", "avx512"};
  const int64_t Ks[] = {576, 1536};
  const size_t stream_bytes = 96u << 20;
  {
    uint64_t *buf = malloc(stream_bytes);
    if (!buf) return 1;
    for (size_t i = 0; i < stream_bytes / 8; i++) buf[i] = i;
    printf("plain read of 96 MB, one thread: %.2f GB/s\n", read_gbs(buf, stream_bytes));
    free(buf);
  }
  printf("%-6s %5s %-8s | %9s %7s | %9s %7s | %9s\n", "format", "K", "isa", "ns/row", "GB/s", "ns/row", "GB/s",
         "ns/row");
  printf("%-6s %5s %-8s | %17s | %17s | %9s\n", "", "", "", "dot1 streamed 96MB", "dot1 cached 1536", "dequant");
  for (size_t fi = 0; fi < sizeof fmts / sizeof fmts[0]; fi++) {
    tp_dtype_t f = fmts[fi];
    int want = argc < 2;
    for (int a = 1; a < argc; a++) want |= !strcmp(argv[a], tp_dtype_name(f));
    if (!want) continue;
    for (size_t ki = 0; ki < 2; ki++) {
      int64_t K = Ks[ki], blk;
      size_t rb;
      tp_weight_format(f, &blk, NULL, NULL);
      K -= K % blk; /* the K-quants' 256-element blocks: 576 -> 512 */
      if (!tp_weight_row_bytes(f, K, &rb)) return 1;
      int64_t N = (int64_t)(stream_bytes / rb);
      uint8_t *W = malloc((size_t)N * rb);
      float *x = malloc((size_t)K * sizeof(float)), *src = malloc((size_t)K * sizeof(float));
      float *y = malloc((size_t)N * sizeof(float));
      if (!W || !x || !src || !y) return 1;
      for (int64_t k = 0; k < K; k++) x[k] = frand();
      for (int64_t n = 0; n < 1536; n++) { /* quantize 1536 distinct rows, copy them over the rest */
        for (int64_t k = 0; k < K; k++) src[k] = frand();
        tp_q_quant_row(f, W + (size_t)n * rb, src, K);
      }
      for (int64_t n = 1536; n < N; n++) memcpy(W + (size_t)n * rb, W + (size_t)(n % 1536) * rb, rb);
      for (int isa = 0; isa <= tp_q_cpu_isa(); isa++) {
        tp_q_dot1_fn dot = tp_q_dot1_at(f, isa);
        double ts = gemv_time(dot, W, rb, x, K, N, y, 3);
        int reps = isa ? 40 : 5;
        double tc = gemv_time(dot, W, rb, x, K, 1536, y, reps);
        double td = dequant_time(f, isa, W, rb, K, 1536, src, reps);
        printf("%-6s %5lld %-8s | %9.1f %7.2f | %9.1f %7.2f | %9.1f\n", tp_dtype_name(f), (long long)K, isa_name[isa],
               1e9 * ts / N, (double)N * rb / ts * 1e-9, 1e9 * tc / 1536, 1536.0 * rb / tc * 1e-9, 1e9 * td / 1536);
        fflush(stdout);
      }
      free(W), free(x), free(src), free(y);
    }
  }
  if (argc < 2 || (argc == 2 && !strcmp(argv[1], "model"))) model_bench();
  return 0;
}
