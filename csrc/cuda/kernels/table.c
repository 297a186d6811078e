/* The CUDA kernel table: every entry of tp_kernel_ops (kernels_impl.h documents them),
 * float32 data with float32 accumulation (double where the CPU uses double), on the
 * caller's stream, never synchronizing, cuBLAS for the GEMMs (opened at run time:
 * cublas.cu).  One .cu file per concern, as cpu/:
 *   linear.cu       gemm linear_forward linear_backward add_bias bias_grad
 *   activations.cu  act_forward act_backward bias_act_forward bias_act_backward(_workspace)
 *   norm.cu         layernorm_forward/backward rmsnorm_forward/backward
 *   rope.cu         rope
 *   attention*.cu   attention_workspace attention_forward attention_backward kv_cache_write
 *                   kv_cache_write_paged positions
 *   embedding.cu    embedding_forward embedding_backward
 *   xent.cu         xent_row_max xent_row_sums xent_loss xent_row_scale xent_backward
 *                   xent_targets xent_targets_hash
 *   checks.cu       check_range
 *   elementwise.cu  add sub scale fill init_uniform init_normal
 *   optim.cu        adamw_step sgd_step
 *   lowp.cu         convert linear_lp_workspace linear_forward_lp linear_backward_lp
 *                   embedding_forward_lp (bfloat16 / float16 weights; quantized ones through
 *                   quant.cu: GGUF blocks and int8 rows)
 * The plugin hands this table to the host (tp_cuda_plugin.kernels), which registers it
 * (csrc/kernels/registry.c). */
#include "cuda_impl.h"

#define TP_CUDA_ENTRY_(name) .name = tp_cuda_##name,

const tp_kernel_ops tp_cuda_kernel_ops = {
    .device = TP_DEVICE_CUDA,
    .name = "cuda",
    .attention_keeps_lse = 1,   /* the fused kernels recompute P from lse: training never keeps T x T */
    .lp_rounds_activations = 1, /* x, dy rounded to the weight dtype for one tensor-core GEMM (lowp.cu) */
    TP_KERNEL_ENTRIES(TP_CUDA_ENTRY_)};
