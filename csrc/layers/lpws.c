/* The scratch of the CPU layers' low-precision GEMMs: one per process, not one per layer.
 * A CPU call has finished when it returns, so the widened weight panels of every layer can
 * share one buffer (the largest panel asked for, 8 MiB with the CPU table); a layer per
 * buffer held 8 MiB for each of a model's projections (384 MiB for GPT-2 small's 48).
 * Calls from several threads take turns on the lock.  A GPU layer keeps its own workspace:
 * its kernels run later, on its stream. */
#include <pthread.h>

#include "layer_kernels.h"

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static tp_arena_t scratch = {TP_DEVICE_CPU, 0, NULL, 0, 0};

tp_arena_t *tp_lp_cpu_scratch_lock(void) {
  pthread_mutex_lock(&lock);
  return &scratch;
}

void tp_lp_cpu_scratch_unlock(void) { pthread_mutex_unlock(&lock); }
