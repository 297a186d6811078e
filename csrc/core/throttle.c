/* The compute throttle (see tpcore/throttle.h). */
#include <errno.h>
#include <math.h>
#include <stdatomic.h>
#include <sys/prctl.h>
#include <time.h>

#include "core_impl.h"
#include "throttle_impl.h"

/* The factor's bits (a double), so that every thread reads it without a lock; 0: off. */
static _Atomic uint64_t throttle_bits;
/* Sleep this thread still owes (seconds; negative: credit from an oversleep). */
static _Thread_local double throttle_debt;
/* Whether this thread's timer slack was lowered (Linux rounds sleeps up by 50 us by default). */
static _Thread_local int throttle_slack_set;

/* Below this much owed time a sleep is not worth its system call: it is carried to the
 * thread's next kernels. */
#define THROTTLE_MIN_SLEEP 20e-6
/* At most this much credit: an oversleep never exempts the next kernels by much. */
#define THROTTLE_MAX_CREDIT 20e-6

static double factor_now(void) {
  uint64_t b = atomic_load_explicit(&throttle_bits, memory_order_relaxed);
  double f;
  memcpy(&f, &b, sizeof f);
  return b ? f : 1.0;
}

static double mono_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

tp_status_t tp_set_throttle(double factor) {
  if (!isfinite(factor) || factor < 1.0 || factor > 1000.0)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "set_throttle: factor must be a finite number in [1, 1000] (1: off), got %g", factor);
  uint64_t b = 0;
  if (factor > 1.0) memcpy(&b, &factor, sizeof b);
  atomic_store_explicit(&throttle_bits, b, memory_order_relaxed);
  throttle_debt = 0;
  return TP_SUCCESS;
}

double tp_get_throttle(void) { return factor_now(); }

double tp_throttle_begin(void) { return atomic_load_explicit(&throttle_bits, memory_order_relaxed) ? mono_s() : -1.0; }

void tp_throttle_end(double t0) {
  double f = factor_now();
  if (t0 < 0 || f <= 1.0) return;
  double now = mono_s(), owed = throttle_debt + (f - 1.0) * (now - t0);
  if (owed < THROTTLE_MIN_SLEEP) {
    throttle_debt = owed;
    return;
  }
  if (!throttle_slack_set) {
    throttle_slack_set = 1;
    (void)prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL); /* best effort: a coarser sleep still works */
  }
  struct timespec req;
  req.tv_sec = (time_t)owed;
  req.tv_nsec = (long)((owed - (double)req.tv_sec) * 1e9);
  if (req.tv_nsec > 999999999L) req.tv_nsec = 999999999L;
  while (nanosleep(&req, &req) != 0 && errno == EINTR) {
  }
  double left = owed - (mono_s() - now);
  throttle_debt = left < -THROTTLE_MAX_CREDIT ? -THROTTLE_MAX_CREDIT : left;
}
