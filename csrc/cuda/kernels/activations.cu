/* Activations on CUDA, forward / backward, float32 (cpu/activations.c has the
 * formulas; here with the device's erff / tanhf / expf).  SwiGLU and GeGLU read
 * h[M, 2F] = [gate | up] per row: silu(gate) * up, gelu_tanh(gate) * up.
 *
 * Launch shapes: act_forward / bias_act_forward one thread per output element (1-D
 * grid-stride over M x F, 256 threads); act_backward / bias_act_backward without db
 * one thread per element of dh (M x hw); bias_act_backward with db: tpk_dh_partial,
 * grid (ceil(hw / 32), P) of 32 x 8 threads, block (x, p) writes dh of its 32 columns
 * for the rows of chunk p and their column sums to partial[p, :] (fixed order), then
 * tpk_db_from_partial (1-D over hw) adds db[c] += partial[0, c] + ... + partial[P-1, c]
 * in order.  P = min(ceil(M / 128), 128), fewer when the workspace is smaller. */
#include "common.cuh"

#define TPK_SQRT_2_OVER_PI 0.7978845608028654f
#define TPK_INV_SQRT_2 0.7071067811865476f
#define TPK_INV_SQRT_2PI 0.3989422804014327f
#define TPK_ROWS_PER_CHUNK 128
#define TPK_MAX_CHUNKS 128

__device__ __forceinline__ float tpk_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* act(x) for the element-wise activations (not the gated ones). */
__device__ __forceinline__ float tpk_act(float x, tp_activation_t act) {
  switch (act) {
    case TP_ACT_GELU: return 0.5f * x * (1.0f + erff(x * TPK_INV_SQRT_2));
    case TP_ACT_GELU_TANH: return 0.5f * x * (1.0f + tanhf(TPK_SQRT_2_OVER_PI * (x + 0.044715f * x * x * x)));
    case TP_ACT_SILU: return x / (1.0f + expf(-x));
    default: return x > 0.0f ? x : 0.0f; /* TP_ACT_RELU */
  }
}

/* d * act'(x). */
__device__ __forceinline__ float tpk_act_grad(float x, float d, tp_activation_t act) {
  switch (act) {
    case TP_ACT_GELU:
      return d * (0.5f * (1.0f + erff(x * TPK_INV_SQRT_2)) + x * TPK_INV_SQRT_2PI * expf(-0.5f * x * x));
    case TP_ACT_GELU_TANH: {
      float t = tanhf(TPK_SQRT_2_OVER_PI * (x + 0.044715f * x * x * x));
      float du = TPK_SQRT_2_OVER_PI * (1.0f + 3.0f * 0.044715f * x * x);
      return d * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du);
    }
    case TP_ACT_SILU: {
      float s = tpk_sigmoid(x);
      return d * s * (1.0f + x * (1.0f - s));
    }
    default: return x > 0.0f ? d : 0.0f;
  }
}

__device__ __forceinline__ bool tpk_gated(tp_activation_t act) { return act == TP_ACT_SWIGLU || act == TP_ACT_GEGLU; }

/* Element (m, c) of dh, c < hw (hw = 2F for SwiGLU / GeGLU: c < F the gate's gradient, else the up's). */
__device__ __forceinline__ float tpk_dh(const float *h, const float *dout, int64_t m, int64_t c, int64_t F,
                                        tp_activation_t act) {
  if (!tpk_gated(act)) return tpk_act_grad(h[m * F + c], dout[m * F + c], act);
  int64_t j = c < F ? c : c - F;
  const float *hr = h + m * 2 * F;
  float g = hr[j], u = hr[F + j], d = dout[m * F + j];
  if (act == TP_ACT_GEGLU) /* gelu_tanh(g) * u */
    return c < F ? tpk_act_grad(g, d * u, TP_ACT_GELU_TANH) : d * tpk_act(g, TP_ACT_GELU_TANH);
  float s = tpk_sigmoid(g);
  return c < F ? d * u * s * (1.0f + g * (1.0f - s)) : d * g * s;
}

/* out[m, j] = act(h (+ b)), h updated to h + b when b (bias_act_forward). */
__global__ void tpk_act_fwd(float *out, float *h_rw, const float *h, const float *b, int64_t M, int64_t F,
                            tp_activation_t act) {
  TPK_GRID_STRIDE(i, M * F) {
    if (tpk_gated(act)) {
      int64_t m = i / F, j = i % F;
      int64_t gi = m * 2 * F + j, ui = gi + F;
      float g = h[gi], u = h[ui];
      if (b) {
        g += b[j];
        u += b[F + j];
        h_rw[gi] = g;
        h_rw[ui] = u;
      }
      out[i] = (act == TP_ACT_SWIGLU ? g / (1.0f + expf(-g)) : tpk_act(g, TP_ACT_GELU_TANH)) * u;
    } else {
      float x = h[i];
      if (b) {
        x += b[i % F];
        h_rw[i] = x;
      }
      out[i] = tpk_act(x, act);
    }
  }
}

__global__ void tpk_act_bwd(float *dh, const float *h, const float *dout, int64_t M, int64_t F, int64_t hw,
                            tp_activation_t act) {
  TPK_GRID_STRIDE(i, M * hw) { dh[i] = tpk_dh(h, dout, i / hw, i % hw, F, act); }
}

/* Block (x, p): columns 32x .. 32x + 31, rows [p * rows, min(M, (p + 1) * rows)). */
__global__ void __launch_bounds__(256)
    tpk_dh_partial(float *dh, float *partial, const float *h, const float *dout, int64_t M, int64_t F, int64_t hw,
                   int64_t rows, tp_activation_t act) {
  __shared__ float sh[8][33];
  int tx = threadIdx.x, ty = threadIdx.y;
  int64_t p = blockIdx.y, r0 = p * rows, r1 = r0 + rows < M ? r0 + rows : M;
  for (int64_t cb = blockIdx.x; cb * 32 < hw; cb += gridDim.x) {
    int64_t c = cb * 32 + tx;
    float acc = 0.0f;
    if (c < hw)
      for (int64_t m = r0 + ty; m < r1; m += 8) {
        float v = tpk_dh(h, dout, m, c, F, act);
        dh[m * hw + c] = v;
        acc += v;
      }
    sh[ty][tx] = acc;
    __syncthreads();
    if (ty == 0 && c < hw) {
      float t = 0.0f;
      for (int r = 0; r < 8; r++) t += sh[r][tx];
      partial[p * hw + c] = t;
    }
    __syncthreads();
  }
}

__global__ void tpk_db_from_partial(float *db, const float *partial, int64_t P, int64_t hw) {
  TPK_GRID_STRIDE(c, hw) {
    float t = 0.0f;
    for (int64_t p = 0; p < P; p++) t += partial[p * hw + c];
    db[c] += t;
  }
}

static int64_t chunks_for(int64_t M) {
  int64_t P = M / TPK_ROWS_PER_CHUNK + (M % TPK_ROWS_PER_CHUNK != 0);
  return P < 1 ? 1 : P > TPK_MAX_CHUNKS ? TPK_MAX_CHUNKS : P;
}

extern "C" tp_status_t tp_cuda_act_forward(tp_stream_t s, float *out, const float *h, int64_t M, int64_t F,
                                           tp_activation_t act) {
  if (M == 0 || F == 0) return TP_SUCCESS;
  tpk_act_fwd<<<tpk_grid(M * F, TPK_THREADS), TPK_THREADS, 0, tpk_stream(s)>>>(out, NULL, h, NULL, M, F, act);
  return tpk_launched("act_forward");
}

extern "C" tp_status_t tp_cuda_bias_act_forward(tp_stream_t s, float *out, float *h, const float *b, int64_t M,
                                                int64_t F, tp_activation_t act) {
  if (M == 0 || F == 0) return TP_SUCCESS;
  tpk_act_fwd<<<tpk_grid(M * F, TPK_THREADS), TPK_THREADS, 0, tpk_stream(s)>>>(out, h, h, b, M, F, act);
  return tpk_launched("bias_act_forward");
}

extern "C" tp_status_t tp_cuda_act_backward(tp_stream_t s, float *dh, const float *h, const float *dout, int64_t M,
                                            int64_t F, tp_activation_t act) {
  int64_t hw = tp_act_gated(act) ? 2 * F : F;
  if (M == 0 || hw == 0) return TP_SUCCESS;
  tpk_act_bwd<<<tpk_grid(M * hw, TPK_THREADS), TPK_THREADS, 0, tpk_stream(s)>>>(dh, h, dout, M, F, hw, act);
  return tpk_launched("act_backward");
}

extern "C" size_t tp_cuda_bias_act_backward_workspace(int64_t M, int64_t F, tp_activation_t act) {
  int64_t hw = tp_act_gated(act) ? 2 * F : F;
  if (M <= 0) return 0;
  size_t n;
  if (!tp_mul_size((size_t)chunks_for(M), (size_t)(hw ? hw : 1) * sizeof(float), &n)) return SIZE_MAX;
  return n;
}

extern "C" tp_status_t tp_cuda_bias_act_backward(tp_stream_t s, float *dh, float *db, const float *h, const float *dout,
                                                 int64_t M, int64_t F, tp_activation_t act, void *workspace,
                                                 size_t workspace_bytes) {
  int64_t hw = tp_act_gated(act) ? 2 * F : F;
  if (!db || M == 0) return tp_cuda_act_backward(s, dh, h, dout, M, F, act);
  size_t row = (size_t)(hw ? hw : 1) * sizeof(float), fit = workspace ? workspace_bytes / row : 0;
  if (fit < 1)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "bias_act_backward: the workspace of %zu bytes is below one row "
                        "of partial sums (%zu bytes)",
                        workspace ? workspace_bytes : 0, row);
  if (hw == 0) return TP_SUCCESS;
  int64_t P = chunks_for(M);
  if ((size_t)P > fit) P = (int64_t)fit; /* fewer chunks: the same sums for the same (sizes, workspace) */
  int64_t rows = M / P + (M % P != 0);
  P = M / rows + (M % rows != 0); /* no empty chunk */
  float *partial = (float *)workspace;
  dim3 grid(tpk_grid(hw, 32), (unsigned)P);
  tpk_dh_partial<<<grid, dim3(32, 8), 0, tpk_stream(s)>>>(dh, partial, h, dout, M, F, hw, rows, act);
  TP_CHECK(tpk_launched("bias_act_backward (dh, partial sums)"));
  tpk_db_from_partial<<<tpk_grid(hw, TPK_THREADS), TPK_THREADS, 0, tpk_stream(s)>>>(db, partial, P, hw);
  return tpk_launched("bias_act_backward (db)");
}
