/* LayerNorm and RMSNorm over the last dimension C on CUDA (cpu/norm.c has the
 * formulas): row statistics accumulated in double as on the CPU, element math in
 * float32.
 *
 * Launch shapes: the row kernels run one block of 256 threads per row (grid-stride
 * over rows, at most 2^20 blocks); thread t takes columns t, t + 256, ...; the sums
 * are block reductions (common.cuh).  dw / db are a separate deterministic column sum
 * (colsum.cuh: 32 x 32 threads per 32 columns) that recomputes xhat from mean / rstd. */
#include <math.h>

#include "colsum.cuh"
#include "common.cuh"

__global__ void __launch_bounds__(TPK_THREADS)
    tpk_layernorm_fwd(float *y, float *mean, float *rstd, const float *x, const float *w, const float *b, int64_t M,
                      int64_t C, float eps) {
  __shared__ double sh[32];
  for (int64_t m = blockIdx.x; m < M; m += gridDim.x) {
    const float *xr = x + m * C;
    double s = 0.0;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) s += xr[c];
    double mu = tpk_block_sum(s, sh) / (double)C;
    double ss = 0.0;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      double d = xr[c] - mu;
      ss += d * d;
    }
    ss = tpk_block_sum(ss, sh);
    float r = (float)(1.0 / sqrt(ss / (double)C + (double)eps)), mf = (float)mu;
    float *yr = y + m * C;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      float v = (xr[c] - mf) * r * w[c];
      yr[c] = b ? v + b[c] : v;
    }
    if (threadIdx.x == 0) {
      if (mean) mean[m] = mf;
      if (rstd) rstd[m] = r;
    }
  }
}

__global__ void __launch_bounds__(TPK_THREADS)
    tpk_layernorm_bwd_dx(float *dx, const float *dy, const float *x, const float *w, const float *mean,
                         const float *rstd, int64_t M, int64_t C) {
  __shared__ double sh[32];
  for (int64_t m = blockIdx.x; m < M; m += gridDim.x) {
    const float *xr = x + m * C, *dr = dy + m * C;
    float mu = mean[m], r = rstd[m];
    double sg = 0.0, sgx = 0.0;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      float xh = (xr[c] - mu) * r, g = dr[c] * w[c];
      sg += g;
      sgx += (double)g * xh;
    }
    sg = tpk_block_sum(sg, sh);
    sgx = tpk_block_sum(sgx, sh);
    float mg = (float)(sg / (double)C), mgx = (float)(sgx / (double)C);
    float *o = dx + m * C;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      float xh = (xr[c] - mu) * r;
      o[c] = r * (dr[c] * w[c] - mg - xh * mgx);
    }
  }
}

__global__ void __launch_bounds__(TPK_THREADS)
    tpk_rmsnorm_fwd(float *y, float *rstd, const float *x, const float *w, int64_t M, int64_t C, float eps) {
  __shared__ double sh[32];
  for (int64_t m = blockIdx.x; m < M; m += gridDim.x) {
    const float *xr = x + m * C;
    double ss = 0.0;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) ss += (double)xr[c] * xr[c];
    ss = tpk_block_sum(ss, sh);
    float r = (float)(1.0 / sqrt(ss / (double)C + (double)eps));
    float *yr = y + m * C;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) yr[c] = xr[c] * r * w[c];
    if (threadIdx.x == 0 && rstd) rstd[m] = r;
  }
}

__global__ void __launch_bounds__(TPK_THREADS)
    tpk_rmsnorm_bwd_dx(float *dx, const float *dy, const float *x, const float *w, const float *rstd, int64_t M,
                       int64_t C) {
  __shared__ double sh[32];
  for (int64_t m = blockIdx.x; m < M; m += gridDim.x) {
    const float *xr = x + m * C, *dr = dy + m * C;
    float r = rstd[m];
    double sgx = 0.0;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) sgx += (double)dr[c] * w[c] * xr[c];
    sgx = tpk_block_sum(sgx, sh);
    float k = (float)(sgx / (double)C) * r * r * r;
    float *o = dx + m * C;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) o[c] = r * dr[c] * w[c] - xr[c] * k;
  }
}

/* dw term dy * xhat and db term dy of LayerNorm. */
struct tpk_ln_terms {
  const float *dy, *x, *mean, *rstd;
  int64_t C;
  __device__ float2 operator()(int64_t m, int64_t c) const {
    float d = dy[m * C + c], xh = (x[m * C + c] - mean[m]) * rstd[m];
    return make_float2(d * xh, d);
  }
};

/* dw term dy * x * rstd of RMSNorm. */
struct tpk_rms_terms {
  const float *dy, *x, *rstd;
  int64_t C;
  __device__ float2 operator()(int64_t m, int64_t c) const {
    return make_float2(dy[m * C + c] * x[m * C + c] * rstd[m], 0.0f);
  }
};

extern "C" tp_status_t tp_cuda_layernorm_forward(tp_stream_t s, float *y, float *mean, float *rstd, const float *x,
                                                 const float *w, const float *b, int64_t M, int64_t C, float eps) {
  if (M == 0) return TP_SUCCESS;
  tpk_layernorm_fwd<<<tpk_grid(M, 1), TPK_THREADS, 0, tpk_stream(s)>>>(y, mean, rstd, x, w, b, M, C, eps);
  return tpk_launched("layernorm_forward");
}

extern "C" tp_status_t tp_cuda_layernorm_backward(tp_stream_t s, float *dx, float *dw, float *db, const float *dy,
                                                  const float *x, const float *w, const float *mean, const float *rstd,
                                                  int64_t M, int64_t C) {
  if (M == 0 || C == 0) return TP_SUCCESS;
  tpk_layernorm_bwd_dx<<<tpk_grid(M, 1), TPK_THREADS, 0, tpk_stream(s)>>>(dx, dy, x, w, mean, rstd, M, C);
  TP_CHECK(tpk_launched("layernorm_backward (dx)"));
  tpk_ln_terms t = {dy, x, mean, rstd, C};
  return tpk_colsum(s, "layernorm_backward (dw, db)", dw, db, M, C, t);
}

extern "C" tp_status_t tp_cuda_rmsnorm_forward(tp_stream_t s, float *y, float *rstd, const float *x, const float *w,
                                               int64_t M, int64_t C, float eps) {
  if (M == 0) return TP_SUCCESS;
  tpk_rmsnorm_fwd<<<tpk_grid(M, 1), TPK_THREADS, 0, tpk_stream(s)>>>(y, rstd, x, w, M, C, eps);
  return tpk_launched("rmsnorm_forward");
}

extern "C" tp_status_t tp_cuda_rmsnorm_backward(tp_stream_t s, float *dx, float *dw, const float *dy, const float *x,
                                                const float *w, const float *rstd, int64_t M, int64_t C) {
  if (M == 0 || C == 0) return TP_SUCCESS;
  tpk_rmsnorm_bwd_dx<<<tpk_grid(M, 1), TPK_THREADS, 0, tpk_stream(s)>>>(dx, dy, x, w, rstd, M, C);
  TP_CHECK(tpk_launched("rmsnorm_backward (dx)"));
  tpk_rms_terms t = {dy, x, rstd, C};
  return tpk_colsum(s, "rmsnorm_backward (dw)", dw, NULL, M, C, t);
}
