/* Block-quantized weight rows on CUDA (quant.cu), private: the kernels lowp.cu's entries run
 * for the weight formats of tp_weight_format past the 16-bit ones: llama.cpp's GGUF blocks
 * TP_Q8_0, TP_Q4_0, TP_Q4_1, TP_Q4_K, TP_Q5_K, TP_Q6_K, and TP_INT8 rows (a float32 scale,
 * then K int8; x = scale q).  A weight is row-major [N rows, K], each row
 * tp_weight_row_bytes(f, K) bytes (K a multiple of the block), rows packed back to back.
 *
 * Every kernel dequantizes eight consecutive elements of a row at a time in registers
 * (every sub-block of every format is a multiple of 8 long, so the eight share their scale
 * and min), with the float32 operations of the gguf package's dequantize_blocks in its
 * order (__fmul_rn / __fsub_rn / __fadd_rn: nvcc may not contract them into an FMA), so the
 * values are llama.cpp's reference values bit for bit. */
#ifndef TPCORE_KERNELS_CUDA_QUANT_CUH
#define TPCORE_KERNELS_CUDA_QUANT_CUH

#include <stddef.h>
#include <stdint.h>

#include "common.cuh"

/* The decode GEMV takes M <= this many rows of x (linear_forward_lp); larger M the GEMM path. */
#define TPK_Q_GEMV_MAX_M 8

/* 1 when quant.cu handles f (tp_weight_is_quantized). */
int tpk_q_format(tp_dtype_t f);

/* y[M, N] = x[M, K] w^T (+ b[N]), 1 <= M <= TPK_Q_GEMV_MAX_M, K >= 1 a multiple of the block:
 * one warp per output row reads the row once, float32 x, float32 products and sums, a fixed
 * order (deterministic). */
tp_status_t tpk_q_gemv(tp_stream_t s, const char *op, float *y, const float *x, const void *w, tp_dtype_t f,
                       const float *b, int64_t M, int64_t K, int64_t N);

/* dst[rows, K] (bfloat16, round to nearest even) = rows n0 .. n0 + rows - 1 of w: a panel
 * for the tensor-core GEMM. */
tp_status_t tpk_q_panel_bf16(tp_stream_t s, const char *op, uint16_t *dst, const void *w, tp_dtype_t f, int64_t n0,
                             int64_t rows, int64_t K);

/* out[M, C] = the dequantized row tokens[m] - lo of table [V, C] when in [0, V), else 0. */
tp_status_t tpk_q_embedding(tp_stream_t s, const char *op, float *out, const int64_t *tokens, const void *table,
                            tp_dtype_t f, int64_t M, int64_t lo, int64_t V, int64_t C);

#endif
