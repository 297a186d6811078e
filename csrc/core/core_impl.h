/* Private helpers of the core: error recording and check macros. */
#ifndef TPCORE_CORE_IMPL_H
#define TPCORE_CORE_IMPL_H

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

/* Records `status` and the formatted sentence as this thread's last error and
 * returns `status`. */
tp_status_t tp_set_error(tp_status_t status, const char *fmt, ...) TP_PRINTF(2, 3);
/* Prefixes the current last-error sentence with "<prefix>: ". */
void tp_error_prefix(const char *fmt, ...) TP_PRINTF(1, 2);
void tp_clear_error(void);

/* Propagate a failing status (the sentence was recorded where it arose). */
#define TP_CHECK(call)                                  \
  do {                                                  \
    tp_status_t tp_st_ = (call);                        \
    if (TP_UNLIKELY(tp_st_ != TP_SUCCESS)) return tp_st_; \
  } while (0)

/* Counter-based random numbers for seeded initialisation: a uniform double in
 * [0, 1) from (seed, tensor, index) by splitmix64, so every element of a full
 * tensor has one value whichever rank draws it. */
static inline double tp_uniform01(uint64_t seed, uint64_t tensor, uint64_t index) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ULL ^ (tensor + 1) * 0xD1B54A32D192ED03ULL ^ index * 0x94D049BB133111EBULL;
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  z ^= z >> 31;
  return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

#define TP_CHECK_GOTO(call, st, label)                   \
  do {                                                   \
    (st) = (call);                                       \
    if (TP_UNLIKELY((st) != TP_SUCCESS)) goto label;     \
  } while (0)

#endif
