/* Element-wise reduction and copy kernels used by the communicators. */
#ifndef TPCORE_REDUCE_IMPL_H
#define TPCORE_REDUCE_IMPL_H

#include <stddef.h>

#include "tpcore/comm.h"

/* dst[i] = srcs[0][i] op srcs[1][i] op ... op srcs[nsrc-1][i], in that order, for
 * i < n.  float16/bfloat16 accumulate in float32 and round once; TP_AVG divides
 * the sum by nsrc (integers accumulate in 64 bits and truncate toward zero);
 * signed integer sums wrap like NumPy's.  dst2, when not NULL, gets the same
 * result.  dst may alias one of the sources element for element. */
void tp_reduce_n(void *dst, void *dst2, const void *const *srcs, int nsrc, size_t n, tp_dtype_t dtype, tp_redop_t op);

/* memcpy that streams past the caches for large copies into memory another
 * core will read (nt != 0). */
void tp_copy(void *dst, const void *src, size_t nbytes, int nt);

#endif
