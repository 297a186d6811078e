/* What quant.c (formats, scalar and portable kernels, dispatch) and quant_x86.c (the AVX-512
 * and AVX2 kernels) share: private to the two. */
#ifndef TPCORE_CPU_QUANT_X86_H
#define TPCORE_CPU_QUANT_X86_H

#include <stdint.h>
#include <string.h>

#include "quant_impl.h"

#if defined(__GNUC__) && defined(__x86_64__) && !defined(TP_NO_CLONES)
#define TP_Q_X86 1
#endif

#define QK 32   /* elements of a Q8_0 / Q4_0 / Q4_1 block */
#define QKK 256 /* elements of a K-quant super-block */

/* One block of a format dequantized into y (the block's elements). */
typedef void (*deq_block_fn)(float *y, const uint8_t *b);

/* An int8 row's float32 scale (its first four bytes). */
static inline float int8_row_scale(const void *row) {
  float s;
  memcpy(&s, row, 4);
  return s;
}

/* A format's kernels at one x86 level (deq NULL for int8 rows, dequantized in quant.c). */
typedef struct {
  tp_q_dot1_fn dot1;
  tp_q_dot4_fn dot4;
  deq_block_fn deq;
} tp_q_x86;

#if TP_Q_X86
/* f's kernels at isa 1 (AVX2 + FMA + F16C) or 2 (AVX-512F); NULL otherwise.  The caller
 * checks that this CPU runs that level. */
const tp_q_x86 *tp_q_x86_kernels(tp_dtype_t f, int isa);
#endif

#endif
