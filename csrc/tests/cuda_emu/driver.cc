// The CUDA kernel table (csrc/cuda/kernels/table.c, every entry of TP_KERNEL_ENTRIES) as the
// harness's table of host memory, named "cudaemu" (run.sh compiles the harness with
// tp_kernels_of -> emu_kernels_of).  Nothing else of the CPU table is in it: an entry the CUDA
// plugin lacks does not link.
#include <cstdio>
#include <cstdlib>

#include "cuda_impl.h"
extern "C" const tp_kernel_ops tp_cuda_kernel_ops; /* table.c */
extern "C" const tp_kernel_ops *emu_kernels_of(tp_device_t d) {
  static tp_kernel_ops t;
  static int init;
  if (d != TP_DEVICE_CPU) return NULL;
  if (!init) {
    t = tp_cuda_kernel_ops;
    t.device = TP_DEVICE_CPU; /* device memory is host memory here */
    t.name = "cudaemu";
    init = 1;
  }
  return &t;
}

namespace {
// The order the run uses, first on stdout (run.sh and the pytest side check both orders ran).
struct say_order {
  say_order() {
    const char *r = getenv("EMU_REVERSE");
    printf("emu order: %s\n", r && *r ? "reverse (threads and blocks last to first)" : "forward");
    fflush(stdout);
  }
} say_order_;
}  // namespace
