/* Element-wise entries on flat arrays on CUDA: add, sub, scale, fill, and the seeded
 * initialisations, which give the CPU's values: tp_uniform01 (core_impl.h) is the same
 * function on the device; init_uniform's arithmetic is written unfused (the CPU
 * rounds each step), so it is bit-identical; init_normal's log1p / cos / sin are the
 * device's double functions (within 1-2 ulp of glibc's in double), so a float32 value
 * differs from the CPU's only when a double lands within an ulp or two of a float32
 * rounding boundary.
 *
 * Launch shapes: 1-D grid-stride, 256 threads, at most 2^20 blocks; add / sub / scale /
 * fill move float4s when every pointer is 16-byte aligned (the tail of n % 4 floats
 * one by one), float otherwise; the initialisations one thread per element. */
#include <math.h>
#include <stdint.h>

#include "common.cuh"

enum { TPK_ADD, TPK_SUB, TPK_SCALE, TPK_FILL };

template <int OP>
__device__ __forceinline__ float tpk_ew(float a, float b, float alpha) {
  return OP == TPK_ADD ? a + b : OP == TPK_SUB ? a - b : OP == TPK_SCALE ? alpha * a : alpha;
}

/* y[i] = op(a[i], b[i]) (a / b unused by fill, b by scale); y may alias a or b exactly:
 * each element is read and written by one thread. */
template <int OP>
__global__ void tpk_ew_kernel(float *y, const float *a, const float *b, float alpha, int64_t n, int vec) {
  int64_t done = 0;
  if (vec) {
    int64_t n4 = n / 4;
    TPK_GRID_STRIDE(i, n4) {
      float4 va = OP == TPK_FILL ? float4{} : reinterpret_cast<const float4 *>(a)[i];
      float4 vb = (OP == TPK_ADD || OP == TPK_SUB) ? reinterpret_cast<const float4 *>(b)[i] : float4{};
      float4 r;
      r.x = tpk_ew<OP>(va.x, vb.x, alpha);
      r.y = tpk_ew<OP>(va.y, vb.y, alpha);
      r.z = tpk_ew<OP>(va.z, vb.z, alpha);
      r.w = tpk_ew<OP>(va.w, vb.w, alpha);
      reinterpret_cast<float4 *>(y)[i] = r;
    }
    done = n4 * 4;
  }
  for (int64_t i = done + (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    float va = OP == TPK_FILL ? 0.0f : a[i];
    float vb = (OP == TPK_ADD || OP == TPK_SUB) ? b[i] : 0.0f;
    y[i] = tpk_ew<OP>(va, vb, alpha);
  }
}

static int aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

template <int OP>
static tp_status_t run_ew(tp_stream_t s, const char *name, float *y, const float *a, const float *b, float alpha,
                          int64_t n) {
  if (n == 0) return TP_SUCCESS;
  int vec = aligned16(y) && (OP == TPK_FILL || aligned16(a)) && ((OP != TPK_ADD && OP != TPK_SUB) || aligned16(b));
  int64_t items = vec ? n / 4 + n % 4 : n;
  tpk_ew_kernel<OP><<<tpk_grid(items, TPK_THREADS), TPK_THREADS, 0, tpk_stream(s)>>>(y, a, b, alpha, n, vec);
  return tpk_launched(name);
}

extern "C" tp_status_t tp_cuda_add(tp_stream_t s, float *y, const float *a, const float *b, int64_t n) {
  return run_ew<TPK_ADD>(s, "add", y, a, b, 0.0f, n);
}

extern "C" tp_status_t tp_cuda_sub(tp_stream_t s, float *y, const float *a, const float *b, int64_t n) {
  return run_ew<TPK_SUB>(s, "sub", y, a, b, 0.0f, n);
}

extern "C" tp_status_t tp_cuda_scale(tp_stream_t s, float *y, const float *x, float alpha, int64_t n) {
  return run_ew<TPK_SCALE>(s, "scale", y, x, NULL, alpha, n);
}

extern "C" tp_status_t tp_cuda_fill(tp_stream_t s, float *y, float value, int64_t n) {
  return run_ew<TPK_FILL>(s, "fill", y, NULL, NULL, value, n);
}

__global__ void tpk_init_uniform(float *y, int64_t n, uint64_t seed, uint64_t tensor, uint64_t index0, float bound) {
  TPK_GRID_STRIDE(i, n) {
    double u = tp_uniform01(seed, tensor, index0 + (uint64_t)i);
    y[i] = (float)__dmul_rn(__dsub_rn(__dmul_rn(2.0, u), 1.0), (double)bound);
  }
}

__global__ void tpk_init_normal(float *y, int64_t n, uint64_t seed, uint64_t tensor, uint64_t index0) {
  TPK_GRID_STRIDE(i, n) {
    uint64_t idx = index0 + (uint64_t)i, p = idx / 2;
    double u1 = tp_uniform01(seed, tensor, 2 * p), u2 = tp_uniform01(seed, tensor, 2 * p + 1);
    double r = sqrt(__dmul_rn(-2.0, log1p(-u1))), a = __dmul_rn(6.283185307179586, u2);
    y[i] = (float)(idx % 2 == 0 ? __dmul_rn(r, cos(a)) : __dmul_rn(r, sin(a)));
  }
}

extern "C" tp_status_t tp_cuda_init_uniform(tp_stream_t s, float *y, int64_t n, uint64_t seed, uint64_t tensor,
                                            uint64_t index0, float bound) {
  if (n == 0) return TP_SUCCESS;
  tpk_init_uniform<<<tpk_grid(n, TPK_THREADS), TPK_THREADS, 0, tpk_stream(s)>>>(y, n, seed, tensor, index0, bound);
  return tpk_launched("init_uniform");
}

extern "C" tp_status_t tp_cuda_init_normal(tp_stream_t s, float *y, int64_t n, uint64_t seed, uint64_t tensor,
                                           uint64_t index0) {
  if (n == 0) return TP_SUCCESS;
  tpk_init_normal<<<tpk_grid(n, TPK_THREADS), TPK_THREADS, 0, tpk_stream(s)>>>(y, n, seed, tensor, index0);
  return tpk_launched("init_normal");
}
