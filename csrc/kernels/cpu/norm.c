/* LayerNorm and RMSNorm over the last dimension (C), forward/backward, and rotary
 * position embeddings.  Row statistics are accumulated in double.
 *
 * LayerNorm:  y = (x - mean) * rstd * w + b,  rstd = 1 / sqrt(var + eps)
 *   backward: g = dy * w;  dx = rstd * (g - mean(g) - xhat * mean(g * xhat));
 *             dw += dy * xhat;  db += dy
 * RMSNorm (Llama): y = x * rstd * w,  rstd = 1 / sqrt(mean(x^2) + eps)
 *   backward: g = dy * w;  dx = rstd * g - x * rstd^3 * mean(g * x);  dw += dy * x * rstd
 * RoPE (the rotate-half form of GPT-NeoX / Llama / Hugging Face): the pairs (i, i + D/2)
 *   of a head turn by pos * theta^(-2i/D); the angle is formed in float32 as in
 *   Hugging Face's implementation, so positions far into a sequence agree with it. */
#include <math.h>

#include "parallel.h"
#include "vmath.h"
#include "cpu_impl.h"

tp_status_t tp_cpu_layernorm_forward(tp_stream_t s, float *y, float *mean, float *rstd, const float *x, const float *w,
                                     const float *b, int64_t M, int64_t C, float eps) {
  (void)s;
  for (int64_t m = 0; m < M; m++) {
    const float *xr = x + m * C;
    double s = 0.0, ss = 0.0;
    for (int64_t c = 0; c < C; c++) s += xr[c];
    double mu = s / (double)C;
    for (int64_t c = 0; c < C; c++) {
      double d = xr[c] - mu;
      ss += d * d;
    }
    float r = (float)(1.0 / sqrt(ss / (double)C + (double)eps)), mf = (float)mu;
    float *yr = y + m * C;
    if (b)
      for (int64_t c = 0; c < C; c++) yr[c] = (xr[c] - mf) * r * w[c] + b[c];
    else
      for (int64_t c = 0; c < C; c++) yr[c] = (xr[c] - mf) * r * w[c];
    if (mean) mean[m] = mf;
    if (rstd) rstd[m] = r;
  }
  return TP_SUCCESS;
}

tp_status_t tp_cpu_layernorm_backward(tp_stream_t s, float *dx, float *dw, float *db, const float *dy, const float *x,
                                      const float *w, const float *mean, const float *rstd, int64_t M, int64_t C) {
  (void)s;
  for (int64_t m = 0; m < M; m++) {
    const float *xr = x + m * C, *dr = dy + m * C;
    float mu = mean[m], r = rstd[m];
    double sg = 0.0, sgx = 0.0;
    for (int64_t c = 0; c < C; c++) {
      float xh = (xr[c] - mu) * r, g = dr[c] * w[c];
      sg += g;
      sgx += (double)g * xh;
      dw[c] += dr[c] * xh;
      if (db) db[c] += dr[c];
    }
    float mg = (float)(sg / (double)C), mgx = (float)(sgx / (double)C);
    float *o = dx + m * C;
    for (int64_t c = 0; c < C; c++) {
      float xh = (xr[c] - mu) * r;
      o[c] = r * (dr[c] * w[c] - mg - xh * mgx);
    }
  }
  return TP_SUCCESS;
}

tp_status_t tp_cpu_rmsnorm_forward(tp_stream_t s, float *y, float *rstd, const float *x, const float *w, int64_t M,
                                   int64_t C, float eps) {
  (void)s;
  for (int64_t m = 0; m < M; m++) {
    const float *xr = x + m * C;
    double ss = 0.0;
    for (int64_t c = 0; c < C; c++) ss += (double)xr[c] * xr[c];
    float r = (float)(1.0 / sqrt(ss / (double)C + (double)eps));
    float *yr = y + m * C;
    for (int64_t c = 0; c < C; c++) yr[c] = xr[c] * r * w[c];
    if (rstd) rstd[m] = r;
  }
  return TP_SUCCESS;
}

tp_status_t tp_cpu_rmsnorm_backward(tp_stream_t s, float *dx, float *dw, const float *dy, const float *x,
                                    const float *w, const float *rstd, int64_t M, int64_t C) {
  (void)s;
  for (int64_t m = 0; m < M; m++) {
    const float *xr = x + m * C, *dr = dy + m * C;
    float r = rstd[m];
    double sgx = 0.0;
    for (int64_t c = 0; c < C; c++) {
      sgx += (double)dr[c] * w[c] * xr[c];
      dw[c] += dr[c] * xr[c] * r;
    }
    float k = (float)(sgx / (double)C) * r * r * r;
    float *o = dx + m * C;
    for (int64_t c = 0; c < C; c++) o[c] = r * dr[c] * w[c] - xr[c] * k;
  }
  return TP_SUCCESS;
}

tp_status_t tp_cpu_rope(tp_stream_t s, float *x, int64_t rows, int64_t ld, int64_t heads, int64_t D, const int64_t *pos,
                        const float *inv_freq, float theta, float factor, int inverse) {
  (void)s;
  int64_t half = D / 2;
  for (int64_t m = 0; m < rows; m++) {
    float p = (float)pos[m];
    float *row = x + m * ld;
    for (int64_t i = 0; i < half; i++) {
      /* Hugging Face: inv_freq = 1 / theta^(2i / D) in float32 (or the scaled table); angle =
       * float32(pos) * inv_freq in float32; cos and sin in float32, then times the attention
       * factor in float32 (x 1 changes nothing) */
      float f = inv_freq ? inv_freq[i] : (float)(1.0 / pow((double)theta, (double)(2 * i) / (double)D));
      float ang = p * f;
      float c = (float)cos((double)ang) * factor, s = (float)sin((double)ang) * factor;
      if (inverse) s = -s;
      for (int64_t h = 0; h < heads; h++) {
        float *v = row + h * D;
        float a = v[i], b = v[i + half];
        v[i] = a * c - b * s;
        v[i + half] = b * c + a * s;
      }
    }
  }
  return TP_SUCCESS;
}
