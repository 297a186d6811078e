/* tp_parallel_rows: short-lived pthreads, started per call.  A call worth
 * splitting costs milliseconds (>= 256K element operations per extra thread),
 * so starting a thread (~20 us) is noise, and nothing keeps spinning between
 * calls to compete with the BLAS threads or the peers' ranks. */
#include <pthread.h>

#include "parallel.h"
#include "tpcore/kernels.h"

enum { MIN_WORK_PER_THREAD = 1 << 18, MAX_THREADS = 64 };

typedef struct {
  tp_rows_fn fn;
  void *ctx;
  int64_t lo, hi;
  int chunk;
} chunk_t;

static void *run_chunk(void *arg) {
  chunk_t *c = arg;
  c->fn(c->ctx, c->lo, c->hi, c->chunk);
  return NULL;
}

int tp_parallel_plan(int64_t rows, int64_t work_per_row) {
  if (rows <= 0) return 1;
  int64_t work; /* saturates: only compared with the per-thread minimum */
  if (__builtin_mul_overflow(rows, work_per_row > 0 ? work_per_row : 1, &work)) work = INT64_MAX;
  int64_t t = tp_get_num_threads();
  if (t > work / MIN_WORK_PER_THREAD) t = work / MIN_WORK_PER_THREAD;
  if (t > rows) t = rows;
  if (t > MAX_THREADS) t = MAX_THREADS;
  return t < 1 ? 1 : (int)t;
}

void tp_parallel_run(int t, int64_t rows, tp_rows_fn fn, void *ctx) {
  if (rows <= 0) return;
  if (t <= 1) {
    fn(ctx, 0, rows, 0);
    return;
  }
  if (t > MAX_THREADS) t = MAX_THREADS;
  chunk_t c[MAX_THREADS];
  pthread_t th[MAX_THREADS];
  int started[MAX_THREADS] = {0};
  for (int i = 0; i < t; i++) {
    c[i] = (chunk_t){fn, ctx, rows * i / t, rows * (i + 1) / t, i};
    if (i > 0) started[i] = pthread_create(&th[i], NULL, run_chunk, &c[i]) == 0;
  }
  fn(ctx, c[0].lo, c[0].hi, 0);
  for (int i = 1; i < t; i++) {
    if (started[i]) pthread_join(th[i], NULL);
    else fn(ctx, c[i].lo, c[i].hi, i); /* no thread to be had: do it here */
  }
}

void tp_parallel_rows(int64_t rows, int64_t work_per_row, tp_rows_fn fn, void *ctx) {
  tp_parallel_run(tp_parallel_plan(rows, work_per_row), rows, fn, ctx);
}
