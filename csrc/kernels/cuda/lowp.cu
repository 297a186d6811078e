/* Low-precision weights on CUDA: weights stored as bfloat16 or float16, everything else
 * float32.  The linear entries round the float32 activations (x, dy) to the weight dtype
 * in the workspace and run one tensor-core GEMM with float32 compute and float32 output
 * (cublasGemmEx, CUBLAS_COMPUTE_32F), so dw, dx and y are float32-accumulated and the
 * float32 main gradient dw is accumulated in place (beta = 1).  Row-major operands go to
 * column-major cuBLAS swapped, as in linear.cu: a row-major [R, C] matrix is a C x R
 * column-major one with leading dimension C.
 *
 * The bit conversions are written out on uint16_t (no cuda_fp16.h / cuda_bf16.h types)
 * and are __host__ __device__, so csrc/tests/cuda_emu runs this very code on the host and
 * the results match core/dtype.c's tp_float_to_half / tp_float_to_bf16 (and so the CPU
 * table) bit for bit: round to nearest even, NaN kept quiet with its sign, past the
 * largest finite value infinity, float16 subnormals kept.  No float arithmetic is used,
 * so flush-to-zero settings cannot touch a subnormal.
 *
 * Launch shapes: convert and the activation rounding 1-D grid-stride (256 threads, at
 * most 2^20 blocks), four elements per thread when both pointers allow 8 / 16-byte
 * vector accesses; the bias / zero rows 1-D over M x N; embedding_forward_lp one block of
 * 256 threads per row (grid-stride over rows); db the deterministic column sum
 * (colsum.cuh).
 *
 * Workspace (linear_lp_workspace): forward M K wdt elements (x rounded); backward the
 * rounded dy (M N elements) at offset 0, then, at the next multiple of 256 bytes, the
 * rounded x (M K elements).  The entries accept less when a part is not needed: backward
 * without dw needs only the dy part, and nothing when neither dx nor dw is asked for. */
#include <limits.h>
#include <string.h>

#include "colsum.cuh"
#include "common.cuh"
#include "cublas_api.h"

/* ---- bit conversions ------------------------------------------------------------ */

static __host__ __device__ inline uint32_t tpk_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static __host__ __device__ inline float tpk_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* bfloat16 is the top half of a float32: widening is exact. */
static __host__ __device__ inline float tpk_bf16_to_f32(uint16_t h) { return tpk_float((uint32_t)h << 16); }

static __host__ __device__ inline uint16_t tpk_f32_to_bf16(float f) {
  uint32_t u = tpk_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u); /* NaN: set the quiet bit */
  /* Round to nearest even on the 16 bits dropped: a carry out of the mantissa bumps the
   * exponent, and out of the largest finite value gives infinity's bits. */
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static __host__ __device__ inline float tpk_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1fu) return tpk_float(sign | 0x7f800000u | (man << 13)); /* inf, NaN (payload kept) */
  if (exp == 0) {
    if (man == 0) return tpk_float(sign);
    /* subnormal man 2^-24: normalise it into a float32 normal, by bits */
    uint32_t e = 113u; /* 127 - 14: the exponent once bit 10 is reached */
    while (!(man & 0x400u)) {
      man <<= 1;
      e--;
    }
    return tpk_float(sign | (e << 23) | ((man & 0x3ffu) << 13));
  }
  return tpk_float(sign | ((exp + 112u) << 23) | (man << 13)); /* rebias 15 -> 127 */
}

static __host__ __device__ inline uint16_t tpk_f32_to_f16(float f) {
  uint32_t u = tpk_bits(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu)); /* NaN: quiet, top payload */
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* |f| >= 65520 (or inf): rounds to infinity */
  if (a >= 0x38800000u) {                                    /* a float16 normal: |f| >= 2^-14 */
    a += 0x0fffu + ((a >> 13) & 1u);                         /* nearest even on the 13 dropped bits */
    return (uint16_t)(sign | ((a - (112u << 23)) >> 13));    /* rebias 127 -> 15 */
  }
  if (a < 0x33000000u) return sign; /* |f| <= 2^-25 rounds to zero (2^-25 itself: the even one) */
  /* a float16 subnormal, in units of 2^-24: the full mantissa shifted right by 14..24 */
  uint32_t man = (a & 0x7fffffu) | 0x800000u;
  uint32_t shift = 126u - (a >> 23);
  uint32_t q = man >> shift, rem = man & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  q += rem > half || (rem == half && (q & 1u)); /* may reach 0x400, the smallest normal: right */
  return (uint16_t)(sign | q);
}

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
__global__ void __launch_bounds__(TPK_THREADS) tpk_embedding_fwd_lp(float *out, const int64_t *tokens,
                                                                    const typename tpk_lp<D>::T *table, int64_t M,
                                                                    int64_t lo, int64_t V, int64_t C) {
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
  return tp_set_error(TP_ERR_INVALID_ARGUMENT, "cuda %s: weight dtype %s is not bfloat16 or float16", op,
                      tp_dtype_name(wdt));
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
  return tp_set_error(TP_ERR_INVALID_ARGUMENT, "cuda %s: workspace of %zu bytes, %zu needed (linear_lp_workspace)",
                      op, have, need);
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
    if (e != cudaSuccess) return tp_set_error(TP_ERR_SYSTEM, "cuda convert: cudaMemcpyAsync: %s", cudaGetErrorString(e));
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
  (void)wdt; /* both 16-bit types take 2 bytes */
  if (!backward) return lp_bytes(M, K);
  size_t xb = lp_bytes(M, K), off = x_offset(lp_bytes(M, N)), total;
  if (xb == SIZE_MAX || off == SIZE_MAX || !tp_add_size(off, xb, &total)) return SIZE_MAX;
  return total;
}

extern "C" tp_status_t tp_cuda_linear_forward_lp(tp_stream_t s, float *y, const float *x, const void *w,
                                                 tp_dtype_t wdt, const float *b, int64_t M, int64_t K, int64_t N,
                                                 void *workspace, size_t workspace_bytes) {
  static const char op[] = "linear_forward_lp";
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
    cublasStatus_t st = api->GemmEx(h, TP_CUBLAS_OP_T, TP_CUBLAS_OP_N, (int)N, (int)mc, (int)K, &one, w, t, (int)K,
                                    x16 + m0 * K, t, (int)K, &beta, y + m0 * N, TP_CUDA_R_32F, (int)N,
                                    TP_CUBLAS_COMPUTE_32F, TP_CUBLAS_GEMM_DEFAULT);
    if (st != TP_CUBLAS_STATUS_SUCCESS) return tp_cublas_error(op, "cublasGemmEx", st);
  }
  return TP_SUCCESS;
}

extern "C" tp_status_t tp_cuda_linear_backward_lp(tp_stream_t s, float *dx, float *dw, float *db, const float *dy,
                                                  const float *x, const void *w, tp_dtype_t wdt, int64_t M,
                                                  int64_t K, int64_t N, int accumulate_dx, void *workspace,
                                                  size_t workspace_bytes) {
  static const char op[] = "linear_backward_lp";
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
        st = api->GemmEx(h, TP_CUBLAS_OP_N, TP_CUBLAS_OP_N, (int)K, (int)mc, (int)N, &one, w, t, (int)K,
                         dy16 + m0 * N, t, (int)N, &bx, dx + m0 * K, TP_CUDA_R_32F, (int)K, TP_CUBLAS_COMPUTE_32F,
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

extern "C" tp_status_t tp_cuda_embedding_forward_lp(tp_stream_t s, float *out, const int64_t *tokens,
                                                    const void *table, tp_dtype_t wdt, int64_t M, int64_t lo,
                                                    int64_t V, int64_t C) {
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
