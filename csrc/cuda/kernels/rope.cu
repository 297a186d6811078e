/* Rotary position embedding on CUDA, in place (cpu/norm.c has the form: the pairs
 * (i, i + D/2) of each head turn by pos * inv_freq[i], the table's or theta^(-2i/D) from
 * a double pow rounded to float32; the angle a float32 product, cos / sin in double
 * rounded to float32 then times factor in float32, exactly the CPU's steps).
 *
 * Launch shape: one thread per (row, i) with i < D/2 (1-D grid-stride over rows x D/2,
 * 256 threads), looping over the heads: each thread owns the elements i and i + D/2 of
 * every head of its row. */
#include <math.h>

#include "common.cuh"

__global__ void tpk_rope(float *x, int64_t rows, int64_t ld, int64_t heads, int64_t D, const int64_t *pos,
                         const float *inv_freq, float theta, float factor, int inverse) {
  int64_t half = D / 2;
  TPK_GRID_STRIDE(idx, rows * half) {
    int64_t m = idx / half, i = idx % half;
    float p = (float)pos[m];
    float f = inv_freq ? inv_freq[i] : (float)(1.0 / pow((double)theta, (double)(2 * i) / (double)D));
    float ang = __fmul_rn(p, f);
    float c = __fmul_rn((float)cos((double)ang), factor), s = __fmul_rn((float)sin((double)ang), factor);
    if (inverse) s = -s;
    float *row = x + m * ld;
    for (int64_t h = 0; h < heads; h++) {
      float *v = row + h * D;
      float a = v[i], b = v[i + half];
      v[i] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)); /* unfused, as the CPU rounds */
      v[i + half] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
    }
  }
}

extern "C" tp_status_t tp_cuda_rope(tp_stream_t s, float *x, int64_t rows, int64_t ld, int64_t heads, int64_t D,
                                    const int64_t *pos, const float *inv_freq, float theta, float factor, int inverse) {
  int64_t half = D / 2;
  if (rows == 0 || half == 0 || heads == 0) return TP_SUCCESS;
  tpk_rope<<<tpk_grid(rows * half, TPK_THREADS), TPK_THREADS, 0, tpk_stream(s)>>>(x, rows, ld, heads, D, pos, inv_freq,
                                                                                  theta, factor, inverse);
  return tpk_launched("rope");
}
