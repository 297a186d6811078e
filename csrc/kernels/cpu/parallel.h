/* A parallel loop over rows for the element-wise kernels (private).  BLAS runs
 * the GEMMs on its own threads; the activation and cross-entropy loops run here
 * on as many threads as this rank's BLAS share (tp_get_num_threads: cores /
 * local ranks), so N local ranks still never oversubscribe the machine. */
#ifndef TPCORE_KERNELS_CPU_PARALLEL_H
#define TPCORE_KERNELS_CPU_PARALLEL_H

#include <stdint.h>

typedef void (*tp_rows_fn)(void *ctx, int64_t lo, int64_t hi);

/* fn(ctx, lo, hi) over [0, rows) in contiguous chunks, one per thread; serial when
 * the work (rows x work_per_row element operations) is too small to pay for a
 * thread (~20 us to start and join). */
void tp_parallel_rows(int64_t rows, int64_t work_per_row, tp_rows_fn fn, void *ctx);

#endif
