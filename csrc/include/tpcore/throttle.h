/*
 * The compute throttle: make this process's compute slower on purpose, so that one rank
 * of a job on one host behaves like a slower device (tests and demos of the shard
 * planner, python/tpcore/planner.py).  After each compute kernel a layer runs (GEMMs,
 * attention, norms, element-wise: csrc/layers/layer_kernels.h) and after the GEMMs of the
 * public kernel API (tp_linear_forward / tp_linear_backward, which Python's direct GEMMs
 * use), the calling thread sleeps (factor - 1) x the kernel's elapsed time: a duty cycle,
 * so factor 2.0 makes compute twice as slow while the collectives stay real.  Short
 * kernels accumulate their sleep until it is worth a system call (a thread's debt; an
 * oversleep is credited to its next kernels), so the ratio holds on average for kernels
 * of any length.  On a GPU the throttled call waits for its stream to time the kernel.
 *
 * tp_set_throttle(factor): process-wide; factor 1.0 (the default) turns it off; factor
 * must be finite and in [1, 1000], else TP_ERR_INVALID_ARGUMENT:
 *   "set_throttle: factor must be a finite number in [1, 1000] (1: off), got F"
 * tp_get_throttle(): the current factor.
 */
#ifndef TPCORE_THROTTLE_H
#define TPCORE_THROTTLE_H

#include "tpcore/tpcore.h"

#ifdef __cplusplus
extern "C" {
#endif

TP_API tp_status_t tp_set_throttle(double factor);
TP_API double tp_get_throttle(void);

#ifdef __cplusplus
}
#endif
#endif
