/* Low-precision weights on CUDA: weights stored as bfloat16 or float16, or in a quantized
 * format (quant.cuh: GGUF Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K blocks, int8 rows with a
 * float32 scale), everything else float32.
 *
 * 16-bit weights: the linear entries round the float32 activations (x, dy) to the weight
 * dtype in the workspace and run one tensor-core GEMM with float32 compute and float32
 * output (cublasGemmEx, CUBLAS_COMPUTE_32F), so dw, dx and y are float32-accumulated and the
 * float32 main gradient dw is accumulated in place (beta = 1).  Row-major operands go to
 * column-major cuBLAS swapped, as in linear.cu: a row-major [R, C] matrix is a C x R
 * column-major one with leading dimension C.  The bit conversions are lowp_bits.cuh's.
 *
 * Quantized weights (frozen: dw must be NULL): forward with M <= TPK_Q_GEMV_MAX_M (decode)
 * is quant.cu's dequantizing GEMV, float32 throughout, no workspace; larger M rounds x to
 * bfloat16 in the workspace, then, panel by panel of weight rows, dequantizes the rows to
 * bfloat16 in the workspace (quant.cu) and runs the bfloat16 GEMM into those columns of y.
 * Backward dx = dy w the same way: dy rounded to bfloat16, then per panel of rows n0.. a GEMM
 * adding dy[:, n0:] w[n0:, :] into dx.  So a float32 copy of the weight is never made, and
 * the panel path's products carry two bfloat16 roundings (x or dy, and w).
 *
 * Launch shapes: convert and the activation rounding 1-D grid-stride (256 threads, at
 * most 2^20 blocks), four elements per thread when both pointers allow 8 / 16-byte
 * vector accesses; the bias / zero rows 1-D over M x N; embedding_forward_lp one block of
 * 256 threads per row (grid-stride over rows); db the deterministic column sum
 * (colsum.cuh).
 *
 * Workspace (linear_lp_workspace), 16-bit weights: forward M K wdt elements (x rounded);
 * backward the rounded dy (M N elements) at offset 0, then, at the next multiple of 256
 * bytes, the rounded x (M K elements).  The entries accept less when a part is not needed:
 * backward without dw needs only the dy part, and nothing when neither dx nor dw is asked
 * for.  Quantized weights: the rounded x (forward, M K bfloat16; none for the GEMV) or dy
 * (backward, M N bfloat16), then, at the next multiple of 256 bytes, the panel: P rows of K
 * bfloat16, P = N when that takes at most TPK_Q_PANEL_BYTES, else as many rows as fit in it
 * (at least 1).  The entries accept any workspace holding the first part and one panel row
 * (the panel takes the rest: less workspace, more GEMMs), and nothing without dx (backward). */
#include <limits.h>
#include <string.h>

#include "colsum.cuh"
#include "common.cuh"
#include "cublas_api.h"
#include "lowp_bits.cuh"
#include "quant.cuh"

/* The largest panel of dequantized weight rows the quantized GEMM path asks for. */
#define TPK_Q_PANEL_BYTES ((size_t)32 << 20)

/* Element types by tp_dtype_t: the storage type, widening to float and rounding from it. */
template <tp_dtype_t D>
struct tpk_lp;
template <>
struct tpk_lp<TP_FLOAT32> {
  typedef float T;
  static __host__ __device__ inline float widen(float v) { return v; }
  static __host__ __device__ inline float narrow(float v) { return v; }
};
template <>
struct tpk_lp<TP_BFLOAT16> {
  typedef uint16_t T;
  static __host__ __device__ inline float widen(uint16_t v) { return tpk_bf16_to_f32(v); }
  static __host__ __device__ inline uint16_t narrow(float v) { return tpk_f32_to_bf16(v); }
};
template <>
struct tpk_lp<TP_FLOAT16> {
  typedef uint16_t T;
  static __host__ __device__ inline float widen(uint16_t v) { return tpk_f16_to_f32(v); }
  static __host__ __device__ inline uint16_t narrow(float v) { return tpk_f32_to_f16(v); }
};

/* Four elements, for one 8-byte (16-bit types) or 16-byte (float) access. */
template <class T>
struct alignas(4 * sizeof(T)) tpk_vec4 {
  T v[4];
};

/* ---- kernels -------------------------------------------------------------------- */

/* y[i] = narrow(widen(x[i])), i < n; VEC: four at a time over the first n / 4 groups
 * (y and x aligned for it), then the n % 4 tail. */
template <tp_dtype_t YD, tp_dtype_t XD, bool VEC>
__global__ void tpk_convert_kernel(typename tpk_lp<YD>::T *y, const typename tpk_lp<XD>::T *x, int64_t n) {
  typedef typename tpk_lp<YD>::T YT;
  typedef typename tpk_lp<XD>::T XT;
  int64_t head = 0;
  if (VEC) {
    int64_t groups = n / 4;
    TPK_GRID_STRIDE(g, groups) {
      tpk_vec4<XT> a = ((const tpk_vec4<XT> *)x)[g];
      tpk_vec4<YT> b;
      for (int j = 0; j < 4; j++) b.v[j] = tpk_lp<YD>::narrow(tpk_lp<XD>::widen(a.v[j]));
      ((tpk_vec4<YT> *)y)[g] = b;
    }
    head = groups * 4;
  }
  TPK_GRID_STRIDE(i, n - head) y[head + i] = tpk_lp<YD>::narrow(tpk_lp<XD>::widen(x[head + i]));
}

/* y[m, n] = b ? b[n] : 0 over M x N. */
__global__ void tpk_lp_rows(float *y, const float *b, int64_t M, int64_t N) {
  TPK_GRID_STRIDE(i, M * N) y[i] = b ? b[i % N] : 0.0f;
}

template <tp_dtype_t D>
__global__ void __launch_bounds__(TPK_THREADS)
    tpk_embedding_fwd_lp(float *out, const int64_t *tokens, const typename tpk_lp<D>::T *table, int64_t M, int64_t lo,
                         int64_t V, int64_t C) {
  for (int64_t m = blockIdx.x; m < M; m += gridDim.x) {
    uint64_t t = (uint64_t)tokens[m] - (uint64_t)lo; /* in [0, V) iff in the shard */
    float *o = out + m * C;
    if (t < (uint64_t)V) {
      const typename tpk_lp<D>::T *r = table + (int64_t)t * C;
      for (int64_t c = threadIdx.x; c < C; c += blockDim.x) o[c] = tpk_lp<D>::widen(r[c]);
    } else {
      for (int64_t c = threadIdx.x; c < C; c += blockDim.x) o[c] = 0.0f;
    }
  }
}

struct tpk_lp_dy_term {
  const float *dy;
  int64_t N;
  __device__ float2 operator()(int64_t m, int64_t n) const { return make_float2(dy[m * N + n], 0.0f); }
};

/* ---- launchers ------------------------------------------------------------------ */

template <tp_dtype_t YD, tp_dtype_t XD>
static tp_status_t convert_as(tp_stream_t s, const char *op, void *y, const void *x, int64_t n) {
  typedef typename tpk_lp<YD>::T YT;
  typedef typename tpk_lp<XD>::T XT;
  int vec = ((uintptr_t)y % sizeof(tpk_vec4<YT>)) == 0 && ((uintptr_t)x % sizeof(tpk_vec4<XT>)) == 0 && n >= 4;
  if (vec)
    tpk_convert_kernel<YD, XD, true>
        <<<tpk_grid(n / 4, TPK_THREADS), TPK_THREADS, 0, tpk_stream(s)>>>((YT *)y, (const XT *)x, n);
  else
    tpk_convert_kernel<YD, XD, false>
        <<<tpk_grid(n, TPK_THREADS), TPK_THREADS, 0, tpk_stream(s)>>>((YT *)y, (const XT *)x, n);
  return tpk_launched(op);
}

static int lp_dtype(tp_dtype_t d) { return d == TP_BFLOAT16 || d == TP_FLOAT16; }

static tp_status_t bad_wdt(const char *op, tp_dtype_t wdt) {
  return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                      "cuda %s: weight dtype %s is not bfloat16, float16 or a quantized format (int8, q8_0, q4_0, "
                      "q4_1, q4_k, q5_k, q6_k)",
                      op, tp_dtype_name(wdt));
}

/* x (float32, n elements) rounded to wdt into dst. */
static tp_status_t round_to(tp_stream_t s, const char *op, void *dst, tp_dtype_t wdt, const float *x, int64_t n) {
  if (n == 0) return TP_SUCCESS;
  return wdt == TP_BFLOAT16 ? convert_as<TP_BFLOAT16, TP_FLOAT32>(s, op, dst, x, n)
                            : convert_as<TP_FLOAT16, TP_FLOAT32>(s, op, dst, x, n);
}

static tp_status_t rows(tp_stream_t s, const char *op, float *y, const float *b, int64_t M, int64_t N) {
  if (M == 0 || N == 0) return TP_SUCCESS;
  tpk_lp_rows<<<tpk_grid(M * N, TPK_THREADS), TPK_THREADS, 0, tpk_stream(s)>>>(y, b, M, N);
  return tpk_launched(op);
}

static tp_status_t int_range(const char *op, const char *what, int64_t v) {
  if (v > INT_MAX)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "cuda %s: %s = %lld is past cuBLAS's int range", op, what,
                        (long long)v);
  return TP_SUCCESS;
}

static int cuda_type(tp_dtype_t wdt) { return wdt == TP_BFLOAT16 ? TP_CUDA_R_16BF : TP_CUDA_R_16F; }

/* Bytes of rows x cols elements of 16 bits, or SIZE_MAX past size_t. */
static size_t lp_bytes(int64_t rows_, int64_t cols) {
  size_t n;
  if (!tp_mul_size((size_t)rows_, (size_t)cols, &n) || !tp_mul_size(n, 2, &n)) return SIZE_MAX;
  return n;
}

/* The offset of the rounded x in the backward workspace: after dy's part, 256-aligned. */
static size_t x_offset(size_t dy_bytes) {
  size_t o;
  if (dy_bytes == SIZE_MAX || !tp_add_size(dy_bytes, 255, &o)) return SIZE_MAX;
  return o & ~(size_t)255;
}

static tp_status_t too_small(const char *op, size_t need, size_t have) {
  if (need == SIZE_MAX) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "cuda %s: the workspace size overflows", op);
  return tp_set_error(TP_ERR_INVALID_ARGUMENT, "cuda %s: workspace of %zu bytes, %zu needed (linear_lp_workspace)", op,
                      have, need);
}

/* ---- quantized weights ---------------------------------------------------------- */

/* Panel rows for K: all N when they take at most TPK_Q_PANEL_BYTES in bfloat16, else as many
 * as fit (at least 1). */
static int64_t q_panel_rows(int64_t K, int64_t N) {
  int64_t r = (int64_t)(TPK_Q_PANEL_BYTES / ((size_t)K * 2));
  if (r < 1) r = 1;
  return r < N ? r : N;
}

/* The weight's rows are whole blocks (before any launch). */
static tp_status_t q_check_k(const char *op, tp_dtype_t wdt, int64_t K) {
  size_t rb;
  int64_t blk = 1;
  if (!tp_weight_row_bytes(wdt, K, &rb)) {
    tp_weight_format(wdt, &blk, NULL, NULL);
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "cuda %s: K = %lld is not a multiple of the %s block (%lld elements)",
                        op, (long long)K, tp_dtype_name(wdt), (long long)blk);
  }
  return TP_SUCCESS;
}

/* The panel's offset and rows in a workspace whose first part is `first` bytes (x or dy in
 * bfloat16), or the refusal when not even one row fits. */
static tp_status_t q_panel_in(const char *op, size_t first, int64_t K, int64_t N, void *ws, size_t wsb, size_t *off,
                              int64_t *rows_) {
  size_t o = x_offset(first), need = SIZE_MAX, row = lp_bytes(1, K);
  if (o != SIZE_MAX && row != SIZE_MAX && !tp_add_size(o, row, &need)) need = SIZE_MAX;
  if (!ws || wsb < need) return too_small(op, need, wsb);
  int64_t r = (int64_t)((wsb - o) / row);
  *off = o;
  *rows_ = r < N ? r : N;
  return TP_SUCCESS;
}

static tp_status_t forward_q(tp_stream_t s, float *y, const float *x, const void *w, tp_dtype_t wdt, const float *b,
                             int64_t M, int64_t K, int64_t N, void *ws, size_t wsb) {
  static const char op[] = "linear_forward_lp";
  TP_CHECK(q_check_k(op, wdt, K));
  if (M == 0 || N == 0) return TP_SUCCESS;
  if (K == 0) return rows(s, "linear_forward_lp (bias rows)", y, b, M, N);
  if (M <= TPK_Q_GEMV_MAX_M) return tpk_q_gemv(s, "linear_forward_lp (gemv)", y, x, w, wdt, b, M, K, N);
  size_t off = 0;
  int64_t P = 1;
  TP_CHECK(q_panel_in(op, lp_bytes(M, K), K, N, ws, wsb, &off, &P)); /* refusals before the first launch */
  TP_CHECK(int_range(op, "K", K));
  TP_CHECK(int_range(op, "N", N));
  const tp_cublas_api *api;
  cublasHandle_t h;
  TP_CHECK(tp_cublas_get(op, s, &api, &h));
  TP_CHECK(rows(s, "linear_forward_lp (bias rows)", y, b, M, N));
  TP_CHECK(round_to(s, "linear_forward_lp (round x)", ws, TP_BFLOAT16, x, M * K));
  const uint16_t *x16 = (const uint16_t *)ws;
  uint16_t *panel = (uint16_t *)((char *)ws + off);
  float one = 1.0f, beta = b ? 1.0f : 0.0f;
  for (int64_t n0 = 0; n0 < N; n0 += P) {
    int64_t nc = N - n0 < P ? N - n0 : P;
    TP_CHECK(tpk_q_panel_bf16(s, "linear_forward_lp (dequantize)", panel, w, wdt, n0, nc, K));
    for (int64_t m0 = 0; m0 < M; m0 += INT_MAX) { /* y[m0:, n0:n0+nc]^T = panel x16[m0:]^T: panel K x nc, op T */
      int64_t mc = M - m0 < INT_MAX ? M - m0 : INT_MAX;
      cublasStatus_t st =
          api->GemmEx(h, TP_CUBLAS_OP_T, TP_CUBLAS_OP_N, (int)nc, (int)mc, (int)K, &one, panel, TP_CUDA_R_16BF, (int)K,
                      x16 + m0 * K, TP_CUDA_R_16BF, (int)K, &beta, y + m0 * N + n0, TP_CUDA_R_32F, (int)N,
                      TP_CUBLAS_COMPUTE_32F, TP_CUBLAS_GEMM_DEFAULT);
      if (st != TP_CUBLAS_STATUS_SUCCESS) return tp_cublas_error(op, "cublasGemmEx", st);
    }
  }
  return TP_SUCCESS;
}

static tp_status_t backward_q(tp_stream_t s, float *dx, float *dw, float *db, const float *dy, const void *w,
                              tp_dtype_t wdt, int64_t M, int64_t K, int64_t N, int accumulate_dx, void *ws,
                              size_t wsb) {
  static const char op[] = "linear_backward_lp";
  if (dw)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "cuda %s: dw must be NULL for %s weights (quantized weights are frozen: no weight gradient)",
                        op, tp_dtype_name(wdt));
  TP_CHECK(q_check_k(op, wdt, K));
  int do_dx = dx && M && K && N;
  if (dx && M && K && !N && !accumulate_dx) TP_CHECK(rows(s, "linear_backward_lp (dx = 0)", dx, NULL, M, K));
  if (do_dx) {
    size_t off = 0;
    int64_t P = 1;
    TP_CHECK(q_panel_in(op, lp_bytes(M, N), K, N, ws, wsb, &off, &P)); /* refusals before the first launch */
    TP_CHECK(int_range(op, "K", K));
    TP_CHECK(int_range(op, "N", N));
    const tp_cublas_api *api;
    cublasHandle_t h;
    TP_CHECK(tp_cublas_get(op, s, &api, &h));
    TP_CHECK(round_to(s, "linear_backward_lp (round dy)", ws, TP_BFLOAT16, dy, M * N));
    const uint16_t *dy16 = (const uint16_t *)ws;
    uint16_t *panel = (uint16_t *)((char *)ws + off);
    float one = 1.0f, bx = accumulate_dx ? 1.0f : 0.0f;
    for (int64_t n0 = 0; n0 < N; n0 += P) {
      int64_t nc = N - n0 < P ? N - n0 : P;
      TP_CHECK(tpk_q_panel_bf16(s, "linear_backward_lp (dequantize)", panel, w, wdt, n0, nc, K));
      for (int64_t m0 = 0; m0 < M; m0 += INT_MAX) {
        /* dx[m0:]^T (+)= panel^T dy16[m0:, n0:n0+nc]^T: the panel is K x nc (op N), dy16's
         * columns n0.. nc x mc with leading dimension N; the first panel overwrites or
         * accumulates as asked, the others add */
        int64_t mc = M - m0 < INT_MAX ? M - m0 : INT_MAX;
        cublasStatus_t st =
            api->GemmEx(h, TP_CUBLAS_OP_N, TP_CUBLAS_OP_N, (int)K, (int)mc, (int)nc, &one, panel, TP_CUDA_R_16BF,
                        (int)K, dy16 + m0 * N + n0, TP_CUDA_R_16BF, (int)N, n0 == 0 ? &bx : &one, dx + m0 * K,
                        TP_CUDA_R_32F, (int)K, TP_CUBLAS_COMPUTE_32F, TP_CUBLAS_GEMM_DEFAULT);
        if (st != TP_CUBLAS_STATUS_SUCCESS) return tp_cublas_error("linear_backward_lp (dx)", "cublasGemmEx", st);
      }
    }
  }
  if (db && M && N) {
    tpk_lp_dy_term term = {dy, N};
    return tpk_colsum(s, "linear_backward_lp (db)", db, NULL, M, N, term);
  }
  return TP_SUCCESS;
}

/* ---- entries -------------------------------------------------------------------- */

#define TPK_CONVERT_CASE_(YD, XD) \
  if (ydt == YD && xdt == XD) return convert_as<YD, XD>(s, "convert", y, x, n);

extern "C" tp_status_t tp_cuda_convert(tp_stream_t s, void *y, tp_dtype_t ydt, const void *x, tp_dtype_t xdt,
                                       int64_t n) {
  if ((ydt != TP_FLOAT32 && !lp_dtype(ydt)) || (xdt != TP_FLOAT32 && !lp_dtype(xdt)))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "cuda convert: %s to %s is not a float32 / bfloat16 / float16 pair",
                        tp_dtype_name(xdt), tp_dtype_name(ydt));
  if (n == 0) return TP_SUCCESS;
  if (ydt == xdt) {
    cudaError_t e = cudaMemcpyAsync(y, x, (size_t)n * tp_dtype_size(ydt), cudaMemcpyDeviceToDevice, tpk_stream(s));
    if (e != cudaSuccess)
      return tp_set_error(TP_ERR_SYSTEM, "cuda convert: cudaMemcpyAsync: %s", cudaGetErrorString(e));
    return TP_SUCCESS;
  }
  TPK_CONVERT_CASE_(TP_BFLOAT16, TP_FLOAT32)
  TPK_CONVERT_CASE_(TP_FLOAT16, TP_FLOAT32)
  TPK_CONVERT_CASE_(TP_FLOAT32, TP_BFLOAT16)
  TPK_CONVERT_CASE_(TP_FLOAT32, TP_FLOAT16)
  TPK_CONVERT_CASE_(TP_FLOAT16, TP_BFLOAT16) /* through float32: exact widening, one rounding */
  TPK_CONVERT_CASE_(TP_BFLOAT16, TP_FLOAT16)
  return TP_SUCCESS; /* not reached: every pair of distinct types is above */
}
#undef TPK_CONVERT_CASE_

extern "C" size_t tp_cuda_linear_lp_workspace(int64_t M, int64_t K, int64_t N, tp_dtype_t wdt, int backward) {
  if (tpk_q_format(wdt)) { /* the rounded x or dy, then the panel */
    if (M == 0 || K == 0 || N == 0 || (!backward && M <= TPK_Q_GEMV_MAX_M)) return 0;
    size_t off = x_offset(lp_bytes(M, backward ? N : K)), pb = lp_bytes(q_panel_rows(K, N), K), total;
    if (off == SIZE_MAX || pb == SIZE_MAX || !tp_add_size(off, pb, &total)) return SIZE_MAX;
    return total;
  }
  /* both 16-bit types take 2 bytes */
  if (!backward) return lp_bytes(M, K);
  size_t xb = lp_bytes(M, K), off = x_offset(lp_bytes(M, N)), total;
  if (xb == SIZE_MAX || off == SIZE_MAX || !tp_add_size(off, xb, &total)) return SIZE_MAX;
  return total;
}

extern "C" tp_status_t tp_cuda_linear_forward_lp(tp_stream_t s, float *y, const float *x, const void *w, tp_dtype_t wdt,
                                                 const float *b, int64_t M, int64_t K, int64_t N, void *workspace,
                                                 size_t workspace_bytes) {
  static const char op[] = "linear_forward_lp";
  if (tpk_q_format(wdt)) return forward_q(s, y, x, w, wdt, b, M, K, N, workspace, workspace_bytes);
  if (!lp_dtype(wdt)) return bad_wdt(op, wdt);
  if (M == 0 || N == 0) return TP_SUCCESS;
  if (K > 0) { /* every refusal before the first launch: y is untouched on error */
    size_t need = lp_bytes(M, K);
    if (!workspace || workspace_bytes < need) return too_small(op, need, workspace_bytes);
    TP_CHECK(int_range(op, "K", K));
    TP_CHECK(int_range(op, "N", N));
  }
  /* y = b (beta = 1 below adds the product to it) or, for K = 0, the whole answer */
  TP_CHECK(rows(s, "linear_forward_lp (bias rows)", y, b, M, N));
  if (K == 0) return TP_SUCCESS;
  TP_CHECK(round_to(s, "linear_forward_lp (round x)", workspace, wdt, x, M * K));
  const tp_cublas_api *api;
  cublasHandle_t h;
  TP_CHECK(tp_cublas_get(op, s, &api, &h));
  const uint16_t *x16 = (const uint16_t *)workspace;
  float one = 1.0f, beta = b ? 1.0f : 0.0f;
  int t = cuda_type(wdt);
  for (int64_t m0 = 0; m0 < M; m0 += INT_MAX) { /* y[m0:, :]^T = W x16[m0:, :]^T, W: op T of K x N */
    int64_t mc = M - m0 < INT_MAX ? M - m0 : INT_MAX;
    cublasStatus_t st =
        api->GemmEx(h, TP_CUBLAS_OP_T, TP_CUBLAS_OP_N, (int)N, (int)mc, (int)K, &one, w, t, (int)K, x16 + m0 * K, t,
                    (int)K, &beta, y + m0 * N, TP_CUDA_R_32F, (int)N, TP_CUBLAS_COMPUTE_32F, TP_CUBLAS_GEMM_DEFAULT);
    if (st != TP_CUBLAS_STATUS_SUCCESS) return tp_cublas_error(op, "cublasGemmEx", st);
  }
  return TP_SUCCESS;
}

extern "C" tp_status_t tp_cuda_linear_backward_lp(tp_stream_t s, float *dx, float *dw, float *db, const float *dy,
                                                  const float *x, const void *w, tp_dtype_t wdt, int64_t M, int64_t K,
                                                  int64_t N, int accumulate_dx, void *workspace,
                                                  size_t workspace_bytes) {
  static const char op[] = "linear_backward_lp";
  if (tpk_q_format(wdt))
    return backward_q(s, dx, dw, db, dy, w, wdt, M, K, N, accumulate_dx, workspace, workspace_bytes);
  if (!lp_dtype(wdt)) return bad_wdt(op, wdt);
  int do_dx = dx && M && K && N, do_dw = dw && M && K && N;
  if (dx && M && K && !N && !accumulate_dx) TP_CHECK(rows(s, "linear_backward_lp (dx = 0)", dx, NULL, M, K));
  if (do_dx || do_dw) { /* refusals before the first launch (the N = 0 one above needs no workspace) */
    size_t dyb = lp_bytes(M, N), off = x_offset(dyb), need = dyb;
    if (do_dw && (off == SIZE_MAX || !tp_add_size(off, lp_bytes(M, K), &need))) need = SIZE_MAX;
    if (!workspace || workspace_bytes < need) return too_small(op, need, workspace_bytes);
    TP_CHECK(int_range(op, "K", K));
    TP_CHECK(int_range(op, "N", N));
    const uint16_t *dy16 = (const uint16_t *)workspace;
    const uint16_t *x16 = (const uint16_t *)((char *)workspace + (do_dw ? off : 0));
    TP_CHECK(round_to(s, "linear_backward_lp (round dy)", workspace, wdt, dy, M * N));
    if (do_dw) TP_CHECK(round_to(s, "linear_backward_lp (round x)", (char *)workspace + off, wdt, x, M * K));
    const tp_cublas_api *api;
    cublasHandle_t h;
    TP_CHECK(tp_cublas_get(op, s, &api, &h));
    float one = 1.0f, bx = accumulate_dx ? 1.0f : 0.0f;
    int t = cuda_type(wdt);
    cublasStatus_t st;
    if (do_dx)
      for (int64_t m0 = 0; m0 < M; m0 += INT_MAX) { /* dx[m0:]^T = W^T dy16[m0:]^T: W is K x N, op N */
        int64_t mc = M - m0 < INT_MAX ? M - m0 : INT_MAX;
        st = api->GemmEx(h, TP_CUBLAS_OP_N, TP_CUBLAS_OP_N, (int)K, (int)mc, (int)N, &one, w, t, (int)K, dy16 + m0 * N,
                         t, (int)N, &bx, dx + m0 * K, TP_CUDA_R_32F, (int)K, TP_CUBLAS_COMPUTE_32F,
                         TP_CUBLAS_GEMM_DEFAULT);
        if (st != TP_CUBLAS_STATUS_SUCCESS) return tp_cublas_error("linear_backward_lp (dx)", "cublasGemmEx", st);
      }
    if (do_dw)
      /* dw^T (K x N, float32) += x16[m0:]^T dy16[m0:]: x16 rows are K x mc, dy16 rows N x mc (op T);
       * the reduction over M in chunks of cuBLAS's int, each accumulated with beta = 1 */
      for (int64_t m0 = 0; m0 < M; m0 += INT_MAX) {
        int64_t mc = M - m0 < INT_MAX ? M - m0 : INT_MAX;
        st = api->GemmEx(h, TP_CUBLAS_OP_N, TP_CUBLAS_OP_T, (int)K, (int)N, (int)mc, &one, x16 + m0 * K, t, (int)K,
                         dy16 + m0 * N, t, (int)N, &one, dw, TP_CUDA_R_32F, (int)K, TP_CUBLAS_COMPUTE_32F,
                         TP_CUBLAS_GEMM_DEFAULT);
        if (st != TP_CUBLAS_STATUS_SUCCESS) return tp_cublas_error("linear_backward_lp (dw)", "cublasGemmEx", st);
      }
  }
  if (db && M && N) { /* from the float32 dy, as the float32 entry */
    tpk_lp_dy_term term = {dy, N};
    return tpk_colsum(s, "linear_backward_lp (db)", db, NULL, M, N, term);
  }
  return TP_SUCCESS;
}

extern "C" tp_status_t tp_cuda_embedding_forward_lp(tp_stream_t s, float *out, const int64_t *tokens, const void *table,
                                                    tp_dtype_t wdt, int64_t M, int64_t lo, int64_t V, int64_t C) {
  if (tpk_q_format(wdt)) return tpk_q_embedding(s, "embedding_forward_lp", out, tokens, table, wdt, M, lo, V, C);
  if (!lp_dtype(wdt)) return bad_wdt("embedding_forward_lp", wdt);
  if (M == 0 || C == 0) return TP_SUCCESS;
  if (wdt == TP_BFLOAT16)
    tpk_embedding_fwd_lp<TP_BFLOAT16>
        <<<tpk_grid(M, 1), TPK_THREADS, 0, tpk_stream(s)>>>(out, tokens, (const uint16_t *)table, M, lo, V, C);
  else
    tpk_embedding_fwd_lp<TP_FLOAT16>
        <<<tpk_grid(M, 1), TPK_THREADS, 0, tpk_stream(s)>>>(out, tokens, (const uint16_t *)table, M, lo, V, C);
  return tpk_launched("embedding_forward_lp");
}
