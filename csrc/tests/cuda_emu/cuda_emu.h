// Host emulation of the CUDA subset the kernels of csrc/cuda/kernels use (run.sh): one block
// at a time, one fiber per CUDA thread (blocks of 1, 2 or 3 dimensions, warps of 32 consecutive
// threads in x-fastest order), cooperative barriers and warp shuffles of any 4- or 8-byte type,
// shared memory poisoned (all bits set: NaN for floats, -1 for integers) when a block starts.
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
struct alignas(16) float4 {
  float x, y, z, w;
};
inline float2 make_float2(float x, float y) { return float2{x, y}; }
// device memory is host memory here; the stream is the host thread
inline cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, cudaMemcpyKind, cudaStream_t) {
  if (n) std::memmove(d, s, n);
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void *d, int v, size_t n, cudaStream_t) {
  if (n) std::memset(d, v, n);
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
// A static __shared__ array (transform.py): all bits set the first time a block reaches its
// declaration, so a read before any write of the block is NaN (or -1), as a dynamic one's.
void emu_poison(void *p, size_t n);
// __syncthreads_count / _or / _and: the predicates of the block add up in emu_pred_acc before
// the barrier; the scheduler moves the sum to emu_pred_sum when it releases the barrier.
extern int emu_pred_acc, emu_pred_sum;
inline void __syncthreads() { emu_wait(0); }
inline int __syncthreads_count(int p) {
  emu_pred_acc += p != 0;
  emu_wait(0);
  return emu_pred_sum;
}
inline int __syncthreads_or(int p) { return __syncthreads_count(p) != 0; }
inline int __syncthreads_and(int p) { return __syncthreads_count(p) == (int)(blockDim.x * blockDim.y * blockDim.z); }
inline unsigned emu_tid() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }
// One exchange slot per lane: each lane stores its value, the warp waits, each reads its source
// lane's, the warp waits again (so no slot is overwritten before every lane has read).  The
// scheduler releases a warp's shuffle when every lane of its mask has arrived, and stops the run
// when a lane of the mask has exited or waits at __syncthreads instead (undefined on a GPU).
extern uint64_t emu_xbuf[32][32];
extern unsigned emu_xmask[32];
[[noreturn]] void emu_bad_shuffle(const char *what);
template <class T>
inline T emu_shfl(unsigned mask, T x, int src) {
  static_assert(sizeof(T) <= 8, "a shuffle moves 4 or 8 bytes");
  unsigned w = emu_tid() / 32, l = emu_tid() % 32;
  if (!(mask >> l & 1)) emu_bad_shuffle("a lane outside its own mask shuffles");
  if (!(mask >> (src & 31) & 1)) emu_bad_shuffle("a shuffle reads a lane outside the mask");
  std::memcpy(&emu_xbuf[w][l], &x, sizeof x);
  emu_xmask[w] = mask;
  emu_wait(1);
  if (emu_xmask[w] != mask) emu_bad_shuffle("the lanes of a shuffle give different masks");
  T y;
  std::memcpy(&y, &emu_xbuf[w][src & 31], sizeof y);
  emu_wait(1);
  return y;
}
// IEEE float32 / float64 operations, never contracted (x86-64 SSE arithmetic; no -mfma)
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
template <class T>
inline T __shfl_xor_sync(unsigned mask, T x, int o) {
  return emu_shfl(mask, x, (int)(emu_tid() % 32) ^ o);
}
template <class T>
inline T __shfl_sync(unsigned mask, T x, int c) {
  return emu_shfl(mask, x, c);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T x, unsigned d) {
  unsigned l = emu_tid() % 32;
  return emu_shfl(mask, x, (int)(l + d < 32 ? l + d : l));
}
void emu_launch(dim3 g, dim3 b, size_t smem, std::function<void()> f);
