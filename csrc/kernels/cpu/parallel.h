/* A parallel loop over rows for the element-wise kernels (private).  BLAS runs
 * the GEMMs on its own threads; the activation and cross-entropy loops run here
 * on as many threads as this rank's BLAS share (tp_get_num_threads: cores /
 * local ranks), so N local ranks still never oversubscribe the machine. */
#ifndef TPCORE_KERNELS_CPU_PARALLEL_H
#define TPCORE_KERNELS_CPU_PARALLEL_H

#include <stdint.h>

/* chunk: 0 .. chunks - 1, in row order (for per-chunk partial results). */
typedef void (*tp_rows_fn)(void *ctx, int64_t lo, int64_t hi, int chunk);

/* How many chunks (threads) tp_parallel_rows would use: 1 when the work (rows x
 * work_per_row element operations) is too small to pay for a thread (~20 us to
 * start and join), else up to this rank's thread count. */
int tp_parallel_plan(int64_t rows, int64_t work_per_row);
/* fn(ctx, lo, hi, chunk) over [0, rows) in `chunks` contiguous chunks, one per thread. */
void tp_parallel_run(int chunks, int64_t rows, tp_rows_fn fn, void *ctx);
/* tp_parallel_run(tp_parallel_plan(rows, work_per_row), rows, fn, ctx) */
void tp_parallel_rows(int64_t rows, int64_t work_per_row, tp_rows_fn fn, void *ctx);

/* Around a tp_parallel_run whose chunks call BLAS themselves: BLAS runs single-threaded
 * inside each chunk (the chunks are the parallelism), then gets its thread count back.
 * (The communicator serves one thread at a time, so nothing else calls BLAS meanwhile.) */
int tp_blas_single_thread_begin(void);
void tp_blas_single_thread_end(int prev);

#endif
