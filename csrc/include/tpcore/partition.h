/*
 * The shard split: which slice of a dimension each rank holds.  One implementation,
 * used by every layer (a linear layer's split dimension, the vocabulary, a block's
 * query heads) and by the Python tpcore.partition().
 *
 * tp_partition(n, world, weights, align, sizes, offsets) is tpcore.partition(n, world,
 * weights, align) exactly (python/tpcore/layers.py), step for step in IEEE double:
 *   units = n / align (n must be a multiple of align);
 *   weights == NULL: sizes[r] = (units / world + (r < units % world)) * align
 *     (even: the first units % world ranks get one unit more);
 *   else, with total = w[0] + w[1] + ... + w[world-1] summed left to right in double
 *     (Python 3.11's sum(); 3.12+ sums floats with compensation: see the report),
 *     exact[r] = ((double)units * w[r]) / total, counts[r] = floor(exact[r]), and the
 *     units - sum(counts) remaining units go one each to the ranks with the largest
 *     remainders exact[r] - counts[r] (ties: the lower rank first); with a negative
 *     remainder count k (rounding), Python's slice [:k] takes all ranks but the last
 *     |k| of that order, and so does this.  sizes[r] = counts[r] * align.
 *   offsets[r] = sizes[0] + ... + sizes[r - 1]; offsets[world] = n.
 * Errors (TP_ERR_INVALID_ARGUMENT; the sentences are Python's, whose type checks stay
 * in Python):
 *   "partition: n must be an integer >= 0, got N"
 *   "partition: world must be an integer >= 1, got W"
 *   "partition: align must be an integer >= 1, got A"
 *   "partition: n=N is not a multiple of align=A"
 *   "partition: weights must be W finite non-negative numbers with a positive sum, got [..]"
 *     (the list printed as Python prints a list of floats: 1.0, 0.3, nan, inf)
 * sizes and offsets may be NULL (not written); offsets has world + 1 entries.
 *
 * tp_partition_sizes checks a partition a caller gave (sizes, world entries) against a
 * dimension of dim, or makes the even one (sizes NULL: as tp_partition without weights,
 * align 1), and writes parts[world] and offsets[world + 1] (either may be NULL).
 * `what` names the argument with its op ("linear: partition", "block: head_partition")
 * and `dim_name` the dimension ("the split dimension (out_features)", "heads"):
 *   "<what>[p] is negative (v)"
 *   "<what> sums past 2^63 - 1 (entry p = v)"
 *   "<what> sums to S but <dim_name> is D"
 *   "<what>: dim must be >= 0 and world >= 1, got D and W"
 */
#ifndef TPCORE_PARTITION_H
#define TPCORE_PARTITION_H

#include "tpcore/tpcore.h"

#ifdef __cplusplus
extern "C" {
#endif

TP_API tp_status_t tp_partition(int64_t n, int world, const double *weights, int64_t align, int64_t *sizes,
                                int64_t *offsets);
TP_API tp_status_t tp_partition_sizes(int64_t dim, int world, const int64_t *sizes, int64_t *parts, int64_t *offsets,
                                      const char *what, const char *dim_name);

#ifdef __cplusplus
}
#endif
#endif
