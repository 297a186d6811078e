// The CUDA kernel table (csrc/cuda/kernels/table.c, every entry of TP_KERNEL_ENTRIES) as the
// harness's table of host memory, named "cudaemu" (run.sh compiles the harness with
// tp_kernels_of -> emu_kernels_of).  Nothing else of the CPU table is in it: an entry the CUDA
// plugin lacks does not link.  The harness's device memory (tp_device_alloc / free ->
// emu_device_alloc / free) is cudaMalloc's: 256-byte aligned, never zeroed (all bits set: NaN,
// -1), and exactly as long as asked, so ASan sees a kernel's access one past the end.
#include <cstdio>
#include <cstdlib>
#include <cstring>

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
    int n = 0, cuda = 0, cpu = 0; /* whose function each entry is (the test counts them) */
#define EMU_COUNT_(e) n++, cuda += t.e == tp_cuda_##e, cpu += t.e == tp_cpu_kernel_ops.e;
    TP_KERNEL_ENTRIES(EMU_COUNT_)
#undef EMU_COUNT_
    printf("emu table: %d entries, %d of the CUDA table, %d of the CPU table\n", n, cuda, cpu);
  }
  return &t;
}

extern "C" tp_status_t emu_device_alloc(tp_device_t d, int id, size_t nbytes, void **ptr) {
  (void)d, (void)id;
  if (posix_memalign(ptr, 256, nbytes ? nbytes : 1)) return tp_set_error(TP_ERR_NOMEM, "emu: out of memory");
  std::memset(*ptr, 0xff, nbytes);
  return TP_SUCCESS;
}
extern "C" void emu_device_free(tp_device_t d, int id, void *ptr) { (void)d, (void)id, free(ptr); }

namespace {
// The order the run uses, first on stdout (run.sh and the pytest side check both orders ran).
struct say_order {
  say_order() {
    const char *r = getenv("EMU_REVERSE");
    printf("emu order: %s\n", r && *r ? "reverse (threads and blocks last to first)" : "forward");
    fflush(stdout);
  }
} say_order_;
} // namespace
