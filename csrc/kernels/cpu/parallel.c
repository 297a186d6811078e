/* tp_parallel_rows: a pool of worker threads that spin briefly, then sleep.
 *
 * A decode step calls a GEMV per projection (4 per block, ~120 per token for a 30-layer
 * model), each 30-250 us of work on one core.  Starting and joining a thread per call cost
 * ~80 us on the VMs measured here (a 960 x 576 Q4_1 GEMV took 106 us on 2 threads against
 * 46 us on one), so the workers stay: after a job a worker spins for TPCORE_POOL_SPIN_US
 * (default 100 us, the gap between two kernels of a step) waiting for the next one, then
 * sleeps on a futex, where it costs nothing (idle ranks, BLAS threads and peers keep the
 * cores).  The caller runs chunk 0 itself, then claims any chunk no worker has started yet
 * and runs it too (a worker the scheduler keeps off a busy core costs no more than running
 * the job on one thread), and waits for the chunks that workers took.
 *
 * One job at a time: a call made while the pool is busy (another thread's job, or a chunk
 * that calls tp_parallel_run itself) runs serially in the caller.  A forked child starts
 * with no workers (pthread_atfork).  Work below MIN_WORK_PER_THREAD element operations
 * per extra thread stays on the caller's thread. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "parallel.h"
#include "tpcore/kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

enum { MIN_WORK_PER_THREAD = 1 << 16, MAX_THREADS = 64 };

static struct {
  pthread_mutex_t lock;      /* held by the caller of a job for its whole length */
  _Atomic uint32_t gen;      /* bumped per job: the workers' futex word */
  _Atomic uint32_t pending;  /* workers still running chunks of the current job */
  _Atomic uint32_t sleepers; /* workers asleep on gen */
  _Atomic int waiter_asleep; /* the caller asleep on pending */
  int nworkers;              /* started (never stopped; only grown) */
  /* the current job, written by its caller before gen is bumped; a worker copies them and
   * checks gen again (a worker outside a job may read while the next one is written) */
  _Atomic(tp_rows_fn) fn;
  _Atomic(void *) ctx;
  _Atomic int64_t rows;
  _Atomic int t; /* chunks of the current job (workers 1 .. t - 1 take one each) */
  long spin_ns;
} pool = {PTHREAD_MUTEX_INITIALIZER, 0, 0, 0, 0, 0, NULL, NULL, 0, 0, -1};

static long futex(_Atomic uint32_t *addr, int op, uint32_t val) {
  return syscall(SYS_futex, (uint32_t *)addr, op | FUTEX_PRIVATE_FLAG, val, NULL, NULL, 0);
}

static long now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static long spin_ns(void) {
  if (pool.spin_ns < 0) {
    const char *e = getenv("TPCORE_POOL_SPIN_US");
    long us = e && *e ? strtol(e, NULL, 10) : 100;
    pool.spin_ns = (us < 0 ? 0 : us > 100000 ? 100000 : us) * 1000L;
  }
  return pool.spin_ns;
}

/* Wait until *word != seen: spin for the pool's spin time, then sleep (sleepers counted so
 * that the waker knows to make the syscall). */
static void wait_change(_Atomic uint32_t *word, uint32_t seen, _Atomic uint32_t *sleepers) {
  long until = now_ns() + spin_ns();
  for (unsigned i = 0; atomic_load(word) == seen; i++) {
    if ((i & 63) == 63 && now_ns() > until) {
      atomic_fetch_add(sleepers, 1); /* seq_cst with the waker's bump-then-read (no lost wake) */
      while (atomic_load(word) == seen) futex(word, FUTEX_WAIT, seen);
      atomic_fetch_sub(sleepers, 1);
      return;
    }
    CPU_RELAX();
  }
}

/* The gen each worker was started at (before the job that started it was published: a
 * worker reading gen itself could miss that job and leave its caller waiting). */
static uint32_t start_gen[MAX_THREADS];
/* claim[i]: the gen of the last job whose chunk i was taken (by worker i or by the caller);
 * the caller of job g sets its chunks' entries to g - 1 before publishing it. */
static _Atomic uint32_t claim[MAX_THREADS];

/* Takes chunk i of job g: 1 for the one thread that gets it.  A worker that read an earlier
 * job g' and was held off the CPU meanwhile never does: g' - claim[i] <= 0 (the entry is g'
 * or later: job g' ended only after every chunk of it was claimed). */
static int take(int i, uint32_t g) {
  uint32_t c = atomic_load(&claim[i]);
  return (int32_t)(g - c) > 0 && atomic_compare_exchange_strong(&claim[i], &c, g);
}

static void done_one(void) {
  if (atomic_fetch_sub(&pool.pending, 1) == 1 && atomic_load(&pool.waiter_asleep)) futex(&pool.pending, FUTEX_WAKE, 1);
}

static void *worker(void *arg) {
  int id = (int)(intptr_t)arg; /* 1 .. nworkers */
  uint32_t seen = start_gen[id];
  for (;;) {
    wait_change(&pool.gen, seen, &pool.sleepers);
    tp_rows_fn fn;
    void *ctx;
    int64_t rows;
    int t;
    for (;;) { /* the job's fields as of one gen */
      uint32_t g = atomic_load(&pool.gen);
      fn = atomic_load(&pool.fn), ctx = atomic_load(&pool.ctx), rows = atomic_load(&pool.rows);
      t = atomic_load(&pool.t);
      if (atomic_load(&pool.gen) == g) {
        seen = g;
        break;
      }
    }
    if (id >= t || !take(id, seen)) continue; /* not part of this job, or the caller took our chunk */
    fn(ctx, rows * id / t, rows * (id + 1) / t, id);
    done_one();
  }
  return NULL;
}

static void after_fork_child(void) {
  pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
  pool.lock = fresh;
  pool.nworkers = 0; /* the parent's workers do not exist here */
  atomic_store(&pool.sleepers, 0);
  atomic_store(&pool.pending, 0);
  atomic_store(&pool.waiter_asleep, 0);
}

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void register_atfork(void) { pthread_atfork(NULL, NULL, after_fork_child); }

/* Workers 1 .. t - 1 exist (started here, detached); returns how many chunks can run. */
static int grow(int t) {
  pthread_once(&atfork_once, register_atfork);
  while (pool.nworkers < t - 1) {
    pthread_t th;
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    start_gen[pool.nworkers + 1] = atomic_load(&pool.gen);
    int ok = pthread_create(&th, &a, worker, (void *)(intptr_t)(pool.nworkers + 1)) == 0;
    pthread_attr_destroy(&a);
    if (!ok) break;
    pool.nworkers++;
  }
  return pool.nworkers + 1 < t ? pool.nworkers + 1 : t;
}

int tp_parallel_plan(int64_t rows, int64_t work_per_row) {
  if (rows <= 0) return 1;
  int64_t work; /* saturates: only compared with the per-thread minimum */
  if (__builtin_mul_overflow(rows, work_per_row > 0 ? work_per_row : 1, &work)) work = INT64_MAX;
  int64_t t = tp_get_num_threads();
  if (t > work / MIN_WORK_PER_THREAD) t = work / MIN_WORK_PER_THREAD;
  if (t > rows) t = rows;
  if (t > MAX_THREADS) t = MAX_THREADS;
  return t < 1 ? 1 : (int)t;
}

void tp_parallel_run(int t, int64_t rows, tp_rows_fn fn, void *ctx) {
  if (rows <= 0) return;
  if (t > MAX_THREADS) t = MAX_THREADS;
  if (t <= 1 || pthread_mutex_trylock(&pool.lock) != 0) { /* small, or the pool is busy: here */
    fn(ctx, 0, rows, 0);
    return;
  }
  t = grow(t);
  if (t <= 1) {
    pthread_mutex_unlock(&pool.lock);
    fn(ctx, 0, rows, 0);
    return;
  }
  atomic_store(&pool.fn, fn), atomic_store(&pool.ctx, ctx), atomic_store(&pool.rows, rows);
  atomic_store(&pool.t, t);
  atomic_store(&pool.pending, (uint32_t)(t - 1));
  uint32_t g = atomic_load(&pool.gen) + 1; /* only the lock's holder changes gen */
  for (int i = 1; i < t; i++) atomic_store(&claim[i], g - 1);
  atomic_fetch_add(&pool.gen, 1); /* publishes job g (seq_cst: then sleepers is read) */
  if (atomic_load(&pool.sleepers)) futex(&pool.gen, FUTEX_WAKE, MAX_THREADS);
  fn(ctx, 0, rows / t, 0);
  for (int i = 1; i < t; i++) /* the chunks no worker has started: here */
    if (take(i, g)) {
      fn(ctx, rows * i / t, rows * (i + 1) / t, i);
      done_one();
    }
  /* the others: spin, then sleep until the last one wakes us */
  long until = now_ns() + spin_ns();
  for (unsigned i = 0;; i++) {
    uint32_t p = atomic_load(&pool.pending);
    if (!p) break;
    if ((i & 63) == 63 && now_ns() > until) {
      atomic_store(&pool.waiter_asleep, 1); /* seq_cst with the last worker's decrement-then-read */
      if ((p = atomic_load(&pool.pending)) != 0) futex(&pool.pending, FUTEX_WAIT, p);
      continue; /* re-read (a wake, a stale value or a spurious return) */
    }
    CPU_RELAX();
  }
  atomic_store(&pool.waiter_asleep, 0);
  pthread_mutex_unlock(&pool.lock);
}

void tp_parallel_rows(int64_t rows, int64_t work_per_row, tp_rows_fn fn, void *ctx) {
  tp_parallel_run(tp_parallel_plan(rows, work_per_row), rows, fn, ctx);
}
