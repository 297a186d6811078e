// Host emulation of the CUDA subset the emulated kernels use (csrc/tests/cuda_emu/run.sh):
// one block at a time, one ucontext fiber per CUDA thread (blocks of 1, 2 or 3 dimensions,
// warps of 32 consecutive threads in x-fastest order), cooperative barriers.
#pragma once
#include <ucontext.h>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>
struct dim3 {
  unsigned x, y, z;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct uint3_ {
  unsigned x, y, z;
};
extern uint3_ threadIdx, blockIdx;
extern dim3 gridDim, blockDim;
typedef int cudaError_t;
typedef void *cudaStream_t;
enum { cudaSuccess = 0, cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum cudaMemcpyKind { cudaMemcpyDeviceToDevice = 3 };
struct float2 {
  float x, y;
};
inline float2 make_float2(float x, float y) { return float2{x, y}; }
// device memory is host memory here; the stream is the host thread
inline cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, cudaMemcpyKind, cudaStream_t) {
  if (n) std::memmove(d, s, n);
  return cudaSuccess;
}
inline const char *cudaGetErrorString(cudaError_t) { return "emu error"; }
inline const char *cudaGetErrorName(cudaError_t) { return "emuError"; }
extern int emu_err;
inline cudaError_t cudaGetLastError() {
  int e = emu_err;
  emu_err = 0;
  return e;
}
extern size_t emu_smem_limit;
template <class F>
cudaError_t cudaFuncSetAttribute(F, int, int v) {
  emu_smem_limit = (size_t)v;
  return 0;
}
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(x)
extern float *emu_smem;
void emu_wait(int kind); /* 0: block barrier, 1: warp barrier */
extern float emu_xbuf[32][32];
inline void __syncthreads() { emu_wait(0); }
inline unsigned emu_tid() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }
inline float emu_shfl(float x, int src) {
  int w = emu_tid() / 32, l = emu_tid() % 32;
  emu_xbuf[w][l] = x;
  emu_wait(1);
  float y = emu_xbuf[w][src];
  emu_wait(1);
  return y;
}
// IEEE float32 operations, never contracted (x86-64 SSE arithmetic; the build has no -mfma)
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __shfl_xor_sync(unsigned, float x, int o) { return emu_shfl(x, (emu_tid() % 32) ^ o); }
inline float __shfl_sync(unsigned, float x, int c) { return emu_shfl(x, c); }
void emu_launch(dim3 g, dim3 b, size_t smem, std::function<void()> f);
