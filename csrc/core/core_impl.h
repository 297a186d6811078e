/* Private helpers of the core: error recording and check macros. */
#ifndef TPCORE_CORE_IMPL_H
#define TPCORE_CORE_IMPL_H

#include <string.h>

#include "tpcore/tpcore.h"

#if defined(__GNUC__)
#define TP_PRINTF(a, b) __attribute__((format(printf, a, b)))
#define TP_LIKELY(x) __builtin_expect(!!(x), 1)
#define TP_UNLIKELY(x) __builtin_expect(!!(x), 0)
#else
#define TP_PRINTF(a, b)
#define TP_LIKELY(x) (x)
#define TP_UNLIKELY(x) (x)
#endif

#ifdef __cplusplus /* C linkage for the CUDA kernels (.cu files are C++) */
extern "C" {
#endif
/* Records `status` and the formatted sentence as this thread's last error and
 * returns `status`. */
tp_status_t tp_set_error(tp_status_t status, const char *fmt, ...) TP_PRINTF(2, 3);
/* Prefixes the current last-error sentence with "<prefix>: ". */
void tp_error_prefix(const char *fmt, ...) TP_PRINTF(1, 2);
void tp_clear_error(void);
#ifdef __cplusplus
}
#endif

/* Propagate a failing status (the sentence was recorded where it arose). */
#define TP_CHECK(call)                                    \
  do {                                                    \
    tp_status_t tp_st_ = (call);                          \
    if (TP_UNLIKELY(tp_st_ != TP_SUCCESS)) return tp_st_; \
  } while (0)

/* Functions the CUDA kernels call on the device too (nvcc compiles them for both). */
#if defined(__CUDACC__)
#define TP_HOST_DEVICE __host__ __device__
#else
#define TP_HOST_DEVICE
#endif

/* Counter-based random numbers for seeded initialisation: a uniform double in
 * [0, 1) from (seed, tensor, index) by splitmix64, so every element of a full
 * tensor has one value whichever rank draws it (on the CPU and on a GPU: integer
 * steps and one exact multiplication, so both give the same bits). */
static inline TP_HOST_DEVICE double tp_uniform01(uint64_t seed, uint64_t tensor, uint64_t index) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ULL ^ (tensor + 1) * 0xD1B54A32D192ED03ULL ^ index * 0x94D049BB133111EBULL;
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  z ^= z >> 31;
  return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

/* Checked size arithmetic: every size, count or offset that comes from a caller is
 * multiplied and added through these before it is used.  Each returns 1 and stores
 * the result, or returns 0 on overflow (or a negative operand for the int64 forms). */
static inline int tp_mul_size(size_t a, size_t b, size_t *out) { return !__builtin_mul_overflow(a, b, out); }
static inline int tp_add_size(size_t a, size_t b, size_t *out) { return !__builtin_add_overflow(a, b, out); }
static inline int tp_mul_count(int64_t a, int64_t b, int64_t *out) {
  return a >= 0 && b >= 0 && !__builtin_mul_overflow(a, b, out);
}
static inline int tp_add_count(int64_t a, int64_t b, int64_t *out) {
  return a >= 0 && b >= 0 && !__builtin_add_overflow(a, b, out);
}

/* The most elements one buffer of a layer may have (4 TiB of float32): a larger shard,
 * workspace or cache is refused as an argument error before any allocation is tried. */
#define TP_MAX_NUMEL ((int64_t)1 << 40)

/* a * b (* c) as an element count in [0, TP_MAX_NUMEL]; 0 when negative or larger. */
static inline int tp_numel2(int64_t a, int64_t b, int64_t *out) {
  return tp_mul_count(a, b, out) && *out <= TP_MAX_NUMEL;
}
static inline int tp_numel3(int64_t a, int64_t b, int64_t c, int64_t *out) {
  int64_t ab;
  return tp_mul_count(a, b, &ab) && tp_mul_count(ab, c, out) && *out <= TP_MAX_NUMEL;
}

/* memcpy / memset that accept a NULL pointer with a zero length (an empty batch). */
#define TP_COPY(dst, src, nbytes)           \
  do {                                      \
    size_t tp_n_ = (nbytes);                \
    if (tp_n_) memcpy((dst), (src), tp_n_); \
  } while (0)
#define TP_ZERO(dst, nbytes)            \
  do {                                  \
    size_t tp_n_ = (nbytes);            \
    if (tp_n_) memset((dst), 0, tp_n_); \
  } while (0)

#define TP_CHECK_GOTO(call, st, label)               \
  do {                                               \
    (st) = (call);                                   \
    if (TP_UNLIKELY((st) != TP_SUCCESS)) goto label; \
  } while (0)

#endif
