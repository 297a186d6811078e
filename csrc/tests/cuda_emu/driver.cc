// The emulated CUDA entries (attention, low precision) in a copy of the CPU kernel table (run.sh).
#include "cuda_impl.h"
extern "C" const tp_kernel_ops *emu_kernels_of(tp_device_t d) {
  static tp_kernel_ops t;
  static int init;
  if (d != TP_DEVICE_CPU) return NULL;
  if (!init) {
    t = tp_cpu_kernel_ops;
    t.name = "cudaemu";
    t.attention_keeps_lse = 1;
    t.attention_workspace = tp_cuda_attention_workspace;
    t.attention_forward = tp_cuda_attention_forward;
    t.attention_backward = tp_cuda_attention_backward;
    t.kv_cache_write = tp_cuda_kv_cache_write;
    t.positions = tp_cuda_positions;
    t.lp_rounds_activations = 1;
    t.convert = tp_cuda_convert;
    t.linear_lp_workspace = tp_cuda_linear_lp_workspace;
    t.linear_forward_lp = tp_cuda_linear_forward_lp;
    t.linear_backward_lp = tp_cuda_linear_backward_lp;
    t.embedding_forward_lp = tp_cuda_embedding_forward_lp;
    init = 1;
  }
  return &t;
}
