/* The CPU's block-quantized weight rows (quant.c): llama.cpp's GGUF formats TP_Q8_0,
 * TP_Q4_0, TP_Q4_1, TP_Q4_K, TP_Q5_K, TP_Q6_K, and TP_INT8 rows (a float32 scale, then K
 * int8; x = scale * q).  A row is tp_weight_row_bytes(f, K) bytes, K a multiple of the
 * format's block (tp_weight_format).  lowp.c builds the layers' entries on these: the GEMV
 * (decode) reads each row once through the dot kernels, the GEMM path dequantizes panels of
 * rows for BLAS, the embedding dequantizes looked-up rows; a full float32 copy of a weight
 * is never made. */
#ifndef TPCORE_CPU_QUANT_IMPL_H
#define TPCORE_CPU_QUANT_IMPL_H

#include <stdint.h>

#include "tpcore/tpcore.h"

/* 1 when f is a format of this file (tp_weight_is_quantized). */
int tp_q_format(tp_dtype_t f);

/* y[K] = the row's values in float32, bit for bit as the gguf package's (llama.cpp's
 * gguf-py) dequantize_blocks: the same float32 operations in the same order, no FMA
 * contraction. */
void tp_q_dequant_row(tp_dtype_t f, float *y, const void *row, int64_t K);

/* row = x[K] quantized (round to nearest, ties away from zero where llama.cpp's reference
 * quantizers do; K-quants with a search for each sub-block's scale and min).  Non-finite x:
 * the caller checks first (the layers refuse them). */
void tp_q_quant_row(tp_dtype_t f, void *row, const float *x, int64_t K);

/* sum_k x[k] w[k] for one row w of format f: the M = 1 (decode) GEMV's inner product, the
 * row dequantized in registers, float32 accumulation in a fixed order for a given K (the
 * result does not depend on threads). */
typedef float (*tp_q_dot1_fn)(const void *row, const float *x, int64_t K);
/* out[j] = sum_k x_j[k] w[k] for four rows of x (callers with fewer pass a row again). */
typedef void (*tp_q_dot4_fn)(float out[4], const void *row, const float *const x[4], int64_t K);

/* The widest kernels this CPU runs for f (AVX-512, AVX2+FMA+F16C, portable), chosen once
 * at run time; TP_LOWP_MAX_ISA (build define) caps the choice for tests. */
tp_q_dot1_fn tp_q_dot1_for(tp_dtype_t f);
tp_q_dot4_fn tp_q_dot4_for(tp_dtype_t f);

/* Tests and benchmarks: the widest ISA level this CPU runs (0 portable, 1 AVX2+FMA+F16C,
 * 2 AVX-512F), and the kernels of one level (NULL when f is not a format of quant.c or the
 * CPU cannot run that level; a level without its own kernel for f gives the narrower one). */
int tp_q_cpu_isa(void);
tp_q_dot1_fn tp_q_dot1_at(tp_dtype_t f, int isa);
tp_q_dot4_fn tp_q_dot4_at(tp_dtype_t f, int isa);
/* tp_q_dequant_row with one level's dequantizer (every level's output is the same, bit for
 * bit); 0 (nothing written) where tp_q_dot1_at gives NULL. */
int tp_q_dequant_row_at(tp_dtype_t f, float *y, const void *row, int64_t K, int isa);

#endif
