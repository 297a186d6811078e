/* Block-quantized weight rows on CUDA (quant.cuh documents the interface).
 *
 * Layouts (llama.cpp's ggml-common.h; every float16 little-endian, read byte by byte since
 * a block is only 2-byte aligned, and an int8 row's float32 scale with memcpy since such a
 * row is only byte aligned):
 *   Q8_0  34 bytes / 32: f16 d, int8 q[32]                        x = q d
 *   Q4_0  18 bytes / 32: f16 d, u8 qs[16]    x[i] = d ((qs[i] & 15) - 8), x[i + 16] from qs[i] >> 4
 *   Q4_1  20 bytes / 32: f16 d, f16 m, u8 qs[16]                  x = d q + m
 *   Q4_K 144 bytes / 256: f16 d, f16 dmin, u8 scales[12], u8 qs[128]: sub-block j (32 elements)
 *        has 6-bit sc_j, m_j; its nibbles are qs[32 (j / 2) + i] >> 4 (j % 2);  x = (d sc_j) q - dmin m_j
 *   Q5_K 176 bytes / 256: as Q4_K with u8 qh[32] before qs: bit j of qh[i] is the fifth bit
 *   Q6_K 210 bytes / 256: u8 ql[128], u8 qh[64], int8 scales[16], f16 d; element r of the
 *        block, r = 128 h + 32 t + i = 128 h + 64 s + e: q = ((ql[64 h + e] >> 4 s) & 15) |
 *        (((qh[32 h + i] >> 2 t) & 3) << 4) - 32;  x = (d scales[r / 16]) q
 *   INT8 rows: f32 scale, int8 q[K]                                x = scale q
 *
 * Launch shapes: the GEMV 256 threads, one warp per output row (grid-stride over rows), lane l
 * taking the row's 8-element chunks l, l + 32, ... (consecutive lanes read consecutive bytes),
 * then an XOR-butterfly warp sum per row of x; the panel 1-D grid-stride over rows x chunks;
 * the embedding one block of 256 per looked-up row (grid-stride over rows). */
#include <string.h>

#include "lowp_bits.cuh"
#include "quant.cuh"

/* ---- dequantization ------------------------------------------------------------- */

static __device__ __forceinline__ float tpk_q_half(const uint8_t *p) {
  return tpk_f16_to_f32((uint16_t)(p[0] | (p[1] << 8)));
}

/* The 6-bit scale and min of sub-block j (0..7) of a K-quant block from its 12 packed bytes
 * (gguf's Q4_K.get_scale_min): j < 4 in the low 6 bits of s[j] and s[j + 4]; j >= 4 four
 * bits of s[j + 4] and the top two of s[j - 4] (scale) or s[j] (min). */
static __device__ __forceinline__ void tpk_q_scale_min(const uint8_t *s, int j, int *sc, int *m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

/* v[0..7] = elements k0 .. k0 + 7 of a row of format F (k0 a multiple of 8).  INT8 rows may
 * end inside a chunk: n (<= 8) elements are read there and v[n..7] = 0; the block formats
 * always pass n = 8. */
template <tp_dtype_t F>
static __device__ __forceinline__ void tpk_q_dequant8(const uint8_t *row, int64_t k0, int n, float v[8]) {
  if constexpr (F == TP_INT8) {
    float sc;
    memcpy(&sc, row, sizeof sc);
    const int8_t *q = (const int8_t *)(row + 4) + k0;
    for (int t = 0; t < 8; t++) v[t] = t < n ? __fmul_rn(sc, (float)q[t]) : 0.0f;
  } else if constexpr (F == TP_Q8_0) {
    const uint8_t *p = row + (k0 >> 5) * 34;
    const int8_t *q = (const int8_t *)(p + 2) + (k0 & 31);
    float d = tpk_q_half(p);
    for (int t = 0; t < 8; t++) v[t] = __fmul_rn((float)q[t], d);
  } else if constexpr (F == TP_Q4_0 || F == TP_Q4_1) {
    const int bytes = F == TP_Q4_0 ? 18 : 20, head = F == TP_Q4_0 ? 2 : 4;
    const uint8_t *p = row + (k0 >> 5) * bytes;
    int o = (int)(k0 & 31), sh = o >= 16 ? 4 : 0;
    const uint8_t *q = p + head + (o & 15);
    float d = tpk_q_half(p);
    if constexpr (F == TP_Q4_0) {
      for (int t = 0; t < 8; t++) v[t] = __fmul_rn(d, (float)(((q[t] >> sh) & 15) - 8));
    } else {
      float m = tpk_q_half(p + 2);
      for (int t = 0; t < 8; t++) v[t] = __fadd_rn(__fmul_rn(d, (float)((q[t] >> sh) & 15)), m);
    }
  } else if constexpr (F == TP_Q4_K || F == TP_Q5_K) {
    const uint8_t *p = row + (k0 >> 8) * (F == TP_Q4_K ? 144 : 176);
    int r = (int)(k0 & 255), j = r >> 5, i0 = r & 31, sh = (j & 1) * 4, sc, mn;
    tpk_q_scale_min(p + 4, j, &sc, &mn);
    float dsc = __fmul_rn(tpk_q_half(p), (float)sc), dmn = __fmul_rn(tpk_q_half(p + 2), (float)mn);
    if constexpr (F == TP_Q4_K) {
      const uint8_t *q = p + 16 + (j >> 1) * 32 + i0;
      for (int t = 0; t < 8; t++) v[t] = __fsub_rn(__fmul_rn(dsc, (float)((q[t] >> sh) & 15)), dmn);
    } else {
      const uint8_t *qh = p + 16 + i0, *q = p + 48 + (j >> 1) * 32 + i0;
      for (int t = 0; t < 8; t++)
        v[t] = __fsub_rn(__fmul_rn(dsc, (float)(((q[t] >> sh) & 15) | (((qh[t] >> j) & 1) << 4))), dmn);
    }
  } else { /* TP_Q6_K */
    static_assert(F == TP_Q6_K, "a weight format without its dequantization");
    const uint8_t *p = row + (k0 >> 8) * 210;
    int r = (int)(k0 & 255), h = r >> 7, rr = r & 127;
    int sl = (rr >> 6) * 4, sh = ((rr >> 5) & 3) * 2;
    const uint8_t *ql = p + h * 64 + (rr & 63), *qh = p + 128 + h * 32 + (rr & 31);
    float d = __fmul_rn(tpk_q_half(p + 208), (float)(int8_t)p[192 + (r >> 4)]);
    for (int t = 0; t < 8; t++) v[t] = __fmul_rn(d, (float)((((ql[t] >> sl) & 15) | (((qh[t] >> sh) & 3) << 4)) - 32));
  }
}

/* ---- kernels -------------------------------------------------------------------- */

template <tp_dtype_t F>
__global__ void __launch_bounds__(TPK_THREADS)
    tpk_q_gemv_kernel(float *y, const float *x, const uint8_t *w, size_t row_bytes, const float *b, int M, int64_t K,
                      int64_t N) {
  int lane = (int)(threadIdx.x & 31);
  int64_t wpb = blockDim.x >> 5, chunks = (K + 7) >> 3;
  for (int64_t n = (int64_t)blockIdx.x * wpb + (threadIdx.x >> 5); n < N; n += (int64_t)gridDim.x * wpb) {
    const uint8_t *row = w + n * row_bytes; /* the warp's row: every lane has the same n */
    float acc[TPK_Q_GEMV_MAX_M];
    for (int m = 0; m < TPK_Q_GEMV_MAX_M; m++) acc[m] = 0.0f;
    for (int64_t c = lane; c < chunks; c += 32) {
      int64_t k0 = c << 3;
      int cnt = F == TP_INT8 && K - k0 < 8 ? (int)(K - k0) : 8; /* block formats: whole chunks */
      float v[8];
      tpk_q_dequant8<F>(row, k0, cnt, v);
#pragma unroll
      for (int m = 0; m < TPK_Q_GEMV_MAX_M; m++) {
        if (m >= M) break;
        const float *xr = x + m * K + k0;
        float s = acc[m];
        for (int t = 0; t < cnt; t++) s += xr[t] * v[t];
        acc[m] = s;
      }
    }
    for (int m = 0; m < M; m++) { /* M is the same in every lane: the shuffles see the whole warp */
      float s = tpk_warp_sum(acc[m]);
      if (lane == 0) y[m * N + n] = b ? s + b[n] : s;
    }
  }
}

template <tp_dtype_t F>
__global__ void tpk_q_panel_kernel(uint16_t *dst, const uint8_t *w, size_t row_bytes, int64_t rows, int64_t K) {
  int64_t chunks = (K + 7) >> 3;
  TPK_GRID_STRIDE(i, rows * chunks) {
    int64_t r = i / chunks, k0 = (i - r * chunks) << 3;
    int cnt = K - k0 < 8 ? (int)(K - k0) : 8;
    float v[8];
    tpk_q_dequant8<F>(w + r * row_bytes, k0, cnt, v);
    uint16_t *o = dst + r * K + k0;
    for (int t = 0; t < cnt; t++) o[t] = tpk_f32_to_bf16(v[t]);
  }
}

template <tp_dtype_t F>
__global__ void __launch_bounds__(TPK_THREADS)
    tpk_q_embedding_kernel(float *out, const int64_t *tokens, const uint8_t *table, size_t row_bytes, int64_t M,
                           int64_t lo, int64_t V, int64_t C) {
  int64_t chunks = (C + 7) >> 3;
  for (int64_t m = blockIdx.x; m < M; m += gridDim.x) {
    uint64_t t = (uint64_t)tokens[m] - (uint64_t)lo; /* in [0, V) iff in the shard */
    float *o = out + m * C;
    if (t < (uint64_t)V) {
      const uint8_t *row = table + (int64_t)t * row_bytes;
      for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
        int64_t k0 = c << 3;
        int cnt = C - k0 < 8 ? (int)(C - k0) : 8;
        float v[8];
        tpk_q_dequant8<F>(row, k0, cnt, v);
        for (int j = 0; j < cnt; j++) o[k0 + j] = v[j];
      }
    } else {
      for (int64_t c = threadIdx.x; c < C; c += blockDim.x) o[c] = 0.0f;
    }
  }
}

/* ---- launchers ------------------------------------------------------------------ */

namespace {

template <tp_dtype_t F>
struct gemv_launch {
  static void run(tp_stream_t s, float *y, const float *x, const uint8_t *w, size_t rb, const float *b, int64_t M,
                  int64_t K, int64_t N) {
    tpk_q_gemv_kernel<F>
        <<<tpk_grid(N, TPK_THREADS / 32), TPK_THREADS, 0, tpk_stream(s)>>>(y, x, w, rb, b, (int)M, K, N);
  }
};

template <tp_dtype_t F>
struct panel_launch {
  static void run(tp_stream_t s, uint16_t *dst, const uint8_t *w, size_t rb, int64_t rows, int64_t K) {
    tpk_q_panel_kernel<F>
        <<<tpk_grid(rows * ((K + 7) >> 3), TPK_THREADS), TPK_THREADS, 0, tpk_stream(s)>>>(dst, w, rb, rows, K);
  }
};

template <tp_dtype_t F>
struct embedding_launch {
  static void run(tp_stream_t s, float *out, const int64_t *tokens, const uint8_t *table, size_t rb, int64_t M,
                  int64_t lo, int64_t V, int64_t C) {
    tpk_q_embedding_kernel<F><<<tpk_grid(M, 1), TPK_THREADS, 0, tpk_stream(s)>>>(out, tokens, table, rb, M, lo, V, C);
  }
};

/* L<f>::run(args...) for the format f (a format of this file: the callers check). */
template <template <tp_dtype_t> class L, class... A>
void dispatch(tp_dtype_t f, A... a) {
  switch (f) {
    case TP_INT8: L<TP_INT8>::run(a...); break;
    case TP_Q8_0: L<TP_Q8_0>::run(a...); break;
    case TP_Q4_0: L<TP_Q4_0>::run(a...); break;
    case TP_Q4_1: L<TP_Q4_1>::run(a...); break;
    case TP_Q4_K: L<TP_Q4_K>::run(a...); break;
    case TP_Q5_K: L<TP_Q5_K>::run(a...); break;
    case TP_Q6_K: L<TP_Q6_K>::run(a...); break;
    default: break;
  }
}

/* A row's bytes, or the error naming op (an unknown format, or K not a multiple of the block). */
tp_status_t row_bytes(const char *op, tp_dtype_t f, int64_t K, size_t *rb) {
  int64_t blk;
  if (!tpk_q_format(f))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "cuda %s: %s is not a quantized weight format", op, tp_dtype_name(f));
  if (!tp_weight_format(f, &blk, NULL, NULL) || !tp_weight_row_bytes(f, K, rb))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "cuda %s: a row of %lld elements is not whole %s blocks of %lld", op,
                        (long long)K, tp_dtype_name(f), (long long)blk);
  return TP_SUCCESS;
}

} // namespace

int tpk_q_format(tp_dtype_t f) { return tp_weight_is_quantized(f); /* dtype.c's list (in the plugin too) */ }

tp_status_t tpk_q_gemv(tp_stream_t s, const char *op, float *y, const float *x, const void *w, tp_dtype_t f,
                       const float *b, int64_t M, int64_t K, int64_t N) {
  size_t rb;
  TP_CHECK(row_bytes(op, f, K, &rb));
  if (M < 1 || M > TPK_Q_GEMV_MAX_M || K < 1)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "cuda %s: the GEMV takes 1..%d rows of x and K >= 1, not M = %lld, "
                        "K = %lld",
                        op, TPK_Q_GEMV_MAX_M, (long long)M, (long long)K);
  if (N == 0) return TP_SUCCESS;
  dispatch<gemv_launch>(f, s, y, x, (const uint8_t *)w, rb, b, M, K, N);
  return tpk_launched(op);
}

tp_status_t tpk_q_panel_bf16(tp_stream_t s, const char *op, uint16_t *dst, const void *w, tp_dtype_t f, int64_t n0,
                             int64_t rows, int64_t K) {
  size_t rb;
  TP_CHECK(row_bytes(op, f, K, &rb));
  if (rows == 0 || K == 0) return TP_SUCCESS;
  dispatch<panel_launch>(f, s, dst, (const uint8_t *)w + (size_t)n0 * rb, rb, rows, K);
  return tpk_launched(op);
}

tp_status_t tpk_q_embedding(tp_stream_t s, const char *op, float *out, const int64_t *tokens, const void *table,
                            tp_dtype_t f, int64_t M, int64_t lo, int64_t V, int64_t C) {
  size_t rb;
  TP_CHECK(row_bytes(op, f, C, &rb));
  if (M == 0 || C == 0) return TP_SUCCESS;
  dispatch<embedding_launch>(f, s, out, tokens, (const uint8_t *)table, rb, M, lo, V, C);
  return tpk_launched(op);
}
