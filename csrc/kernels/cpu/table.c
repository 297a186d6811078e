/* The CPU kernel table: every entry of tp_kernel_ops, float32 compute, BLAS for the
 * GEMMs and this rank's threads (parallel.h) for the row loops. */
#include "cpu_impl.h"

#define TP_CPU_ENTRY_(name) .name = tp_cpu_##name,

const tp_kernel_ops tp_cpu_kernel_ops = {
    .device = TP_DEVICE_CPU,
    .name = "cpu",
    .attention_keeps_lse = 0,   /* keeping probs is faster on the CPU; the lse mode is there too */
    .lp_rounds_activations = 0, /* x and dy stay float32: w is widened, not x rounded */
    TP_KERNEL_ENTRIES(TP_CPU_ENTRY_)};
