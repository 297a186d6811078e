/* Shared pieces of the CUDA attention entries (attention.cu: forward, decode, the KV cache,
 * positions; attention_bwd.cu: backward).  Layouts and semantics are the CPU's
 * (cpu/attention.c, tp_attention_args in tpcore/kernels.h):
 *   query row i of sequence b, head h:  q + (b Tq + i) q_ld + h D      (o, dq alike)
 *   key j of sequence b, KV head g:     k + b kv_bstride + j kv_ld + g D (v, dk, dv alike);
 *                                       forward with kv_slot: k + kv_slot[b] kv_bstride + ...
 *   key j visible to query i (at position p = q_pos[b] + i):  j < min(k_len[b], Tk),
 *                              key_mask[b Tk + j] != 0, with causal j <= p, with a window
 *                              j > p - window; a ring (kv_ring, forward): j < q_pos[b] + Tq
 *                              instead of j < Tk, key j at row j % kv_ring; a paged cache
 *                              (kv_block_size > 0): key j in block table[b cols + j / bs], row
 *                              j % bs, not visible when the entry is no block (key_off)
 *   scores: s = scale q.k, softcap > 0: s = softcap tanh(s / softcap)
 *   lse[(b Hq + h) Tq + i] = max + log(sum exp(s - max)) over the visible scores,
 *                            -inf for a row that sees no key.
 * Every index is int64; every launch is checked (cuda_check) into tp_set_error. */
#ifndef TPCORE_CUDA_ATTENTION_COMMON_CUH
#define TPCORE_CUDA_ATTENTION_COMMON_CUH

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "cuda_impl.h"

namespace tp_attn {

constexpr int kThreads = 128; /* every attention kernel: 4 warps */
constexpr int kMaxD = 256;    /* head sizes the fused kernels take (templates 32, 64, 128, 256) */
constexpr unsigned kFull = 0xffffffffu;

/* A CUDA status into the error record: "cuda attention_forward: <what>: <cuda's words>". */
static inline tp_status_t cuda_check(cudaError_t e, const char *op, const char *what) {
  if (e == cudaSuccess) return TP_SUCCESS;
  return tp_set_error(TP_ERR_SYSTEM, "cuda %s: %s: %s (%s)", op, what, cudaGetErrorString(e), cudaGetErrorName(e));
}

/* The launch just queued (configuration errors show at once; faults of the kernel show
 * at the next synchronizing call, as CUDA reports them). */
static inline tp_status_t launch_check(const char *op, const char *kernel) {
  return cuda_check(cudaGetLastError(), op, kernel);
}

/* Smallest template head size >= D (D <= kMaxD checked by the caller). */
static inline int dmax_of(int64_t D) { return D <= 32 ? 32 : D <= 64 ? 64 : D <= 128 ? 128 : 256; }

/* An odd shared-memory row stride >= D + 1: lanes reading one element of each of 32
 * consecutive rows hit 32 different banks. */
__host__ __device__ inline int smem_ld(int64_t D) { return (int)(D + 1 + (D & 1)); }

/* Local KV head of query head h; outside [0, Hk) means no KV head here (the CPU entry
 * then writes nothing for that head, and neither do these kernels). */
__device__ __forceinline__ int64_t kv_head(const tp_attention_args &a, int64_t h) {
  return a.group ? (a.q_head0 + h) / a.group - a.k_head0 : h / (a.Hq / a.Hk);
}

/* The KV sequence that query sequence b reads: kv_slot[b] (NULL: b); -1 for a slot outside
 * [0, kv_batch) (the CPU entry refuses those on the host; here such a row sees no key). */
__device__ __forceinline__ int64_t kv_seq(const tp_attention_args &a, int64_t b) {
  if (!a.kv_slot) return b;
  const int64_t s = a.kv_slot[b];
  return s >= 0 && s < a.kv_batch ? s : -1;
}

/* Key positions [0, limit) query i of sequence b may see (before the key mask and the window). */
__device__ __forceinline__ int64_t key_limit(const tp_attention_args &a, int64_t b, int64_t i) {
  int64_t n = a.k_len ? a.k_len[b] : a.Tk;
  const int64_t p = (a.q_pos ? a.q_pos[b] : 0) + i;
  if (!a.kv_ring && n > a.Tk) n = a.Tk;
  if (a.kv_ring && n > p - i + a.Tq) n = p - i + a.Tq; /* a ring holds nothing past the step */
  if (a.causal && p + 1 < n) n = p + 1;
  return n < 0 ? 0 : n;
}

/* The first key position query i of sequence b may see: its window's start (0 without); in a
 * ring, never a position this step's writes overwrote (the checks rule that out). */
__device__ __forceinline__ int64_t key_first(const tp_attention_args &a, int64_t b, int64_t i) {
  const int64_t p0 = a.q_pos ? a.q_pos[b] : 0;
  int64_t f = a.window > 0 ? p0 + i - a.window + 1 : 0;
  if (a.kv_ring > 0 && f < p0 + a.Tq - a.kv_ring) f = p0 + a.Tq - a.kv_ring;
  return f > 0 ? f : 0;
}

/* The row of k/v that holds key position j (a ring: j % kv_ring). */
__device__ __forceinline__ int64_t key_row(const tp_attention_args &a, int64_t j) {
  return a.kv_ring > 0 ? j % a.kv_ring : j;
}

/* The element offset of key position j of query sequence b from the KV sequence's base: row
 * key_row(j); in a paged cache (kv_block_size > 0: the base is the pool's start) block
 * kv_block_table[b cols + j / bs], row j % bs; -1 for a key in no block (an entry < 0, or one
 * outside the pool's kv_batch blocks: never read). */
__device__ __forceinline__ int64_t key_off(const tp_attention_args &a, int64_t b, int64_t j) {
  if (a.kv_block_size <= 0) return key_row(a, j) * a.kv_ld;
  const int64_t e = a.kv_block_table[b * a.kv_block_cols + j / a.kv_block_size];
  return e >= 0 && e < a.kv_batch ? e * a.kv_bstride + (j % a.kv_block_size) * a.kv_ld : -1;
}

/* A scaled score soft-capped (softcap > 0: softcap tanh(s / softcap)). */
__device__ __forceinline__ float cap_score(const tp_attention_args &a, float s) {
  return a.softcap > 0.0f ? a.softcap * tanhf(s / a.softcap) : s;
}

/* d(capped)/d(s) at the scaled score s: 1 - tanh^2(s / softcap), 1 without a cap. */
__device__ __forceinline__ float cap_slope(const tp_attention_args &a, float s) {
  if (a.softcap <= 0.0f) return 1.0f;
  const float t = tanhf(s / a.softcap);
  return 1.0f - t * t;
}

__device__ __forceinline__ bool key_on(const tp_attention_args &a, int64_t b, int64_t j) {
  return !a.key_mask || a.key_mask[b * a.Tk + j] != 0;
}

__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(kFull, x, o));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(kFull, x, o);
  return x;
}

/* Blocks of `threads` for a grid-stride loop over n items (at most 65535 x 16). */
static inline unsigned grid_for(int64_t n, int threads) {
  int64_t g = (n + threads - 1) / threads;
  return (unsigned)(g < 1 ? 1 : g > 65535 * 16 ? 65535 * 16 : g);
}

/* Workspace pieces, 256-byte aligned; SIZE_MAX on overflow. */
static inline size_t ws_add(size_t at, int64_t floats) {
  if (at == SIZE_MAX || floats < 0) return SIZE_MAX;
  size_t n;
  if (!tp_mul_size((size_t)floats, sizeof(float), &n)) return SIZE_MAX;
  n = (n + 255) & ~(size_t)255;
  return at > SIZE_MAX - n ? SIZE_MAX : at + n;
}

} // namespace tp_attn

#endif
