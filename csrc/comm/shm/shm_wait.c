/*
 * shm backend: the waits.  A rank waits for a peer's counter (step, p2p sent /
 * acked) to reach a target; every wait has the communicator's timeout, names the
 * rank it waits for and what for, notices an abort published by any rank, and
 * notices a peer that closed the communicator or died (its /proc start time,
 * so a reused pid is not mistaken for it).
 *
 * How a wait spends its time.  A futex sleep and wake-up costs 10-40 us, so with
 * a core per rank a wait spins: a 4 KiB all_reduce takes ~2 us spinning, and a
 * spin of up to 1 ms covers a peer's copy of a few MiB.  But a spin only pays
 * while the peer is on a core: when more processes want the cores than there
 * are (other jobs, `yes > /dev/null`), the peer we wait for is often queued
 * behind them, and every millisecond spun is one it could have run; measured
 * with 2 ranks on 2 cores and 6 busy processes: 581 us per 4 KiB all_reduce
 * spinning against 3.5 us sleeping at once (2.1 us on a quiet machine).
 * Waking a sleeper is cheap there: the scheduler runs a task that slept ahead
 * of the busy ones.
 *
 * So the default wait adapts (after Open MPI's yield-when-idle and the
 * adaptive mutexes of glibc), deciding from what this rank sees of its own core:
 *   - Spin (pause loop) up to the budget (1 ms), reading the clock every 64
 *     pauses.  A gap of more than 200 us between two readings means this rank
 *     was taken off its core for a time slice: the core is contended.  (An
 *     interrupt or a kernel thread takes microseconds, a busy process a slice
 *     of 0.75-3 ms.)
 *   - 50 us into a spin, and every 200 us after, a probe: one sched_yield(),
 *     timed.  On a core nobody else wants it returns in about a microsecond
 *     and the spin goes on; if it took more than 200 us another process ran on
 *     this core: contended.  Waits shorter than 50 us (quiet all_reduce
 *     latency) never probe, so the quiet path is the plain spin it was.
 *   - Contended: this wait goes to sleep on the futex at once, and so do the
 *     communicator's waits for a hold time (no spin: measured under that
 *     load, sleeping at once gave 3.5 us per call against 581 us spinning).
 *     The hold starts at 50 ms and grows 4x, up to 1 s, each time contention
 *     is seen again soon after the last hold ended; so on a machine that stays
 *     busy the probing wait (which may lose a time slice) comes once a second,
 *     and on a machine that turns quiet the full spin is back within a second.
 * With more ranks than cores the ranks compete with each other: no spin, a
 * sched_yield loop of 100 us (TPCORE_YIELD_US) that hands the core to the rank
 * waited for, then the futex.  An explicit spin time (config spin_us >= 0 or
 * TPCORE_SPIN_US) turns the adaptation off: spin that long, then sleep.
 *
 * While asleep a waiter wakes every 20 ms to look at the abort flag, the peer's
 * liveness and its deadline, so every wait keeps its timeout and error.
 */
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "shm_impl.h"

long tp_shm_futex(_Atomic uint32_t *addr, int op, uint32_t val, const struct timespec *ts) {
  return syscall(SYS_futex, (uint32_t *)addr, op, val, ts, NULL, 0);
}

/* Process start time from /proc/<pid>/stat (field 22), 0 if unavailable. */
uint64_t tp_shm_proc_starttime(int pid, char *state) {
  char path[64], buf[1024];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return 0;
  buf[n] = '\0';
  char *p = strrchr(buf, ')');
  if (!p || p[1] != ' ') return 0;
  p += 2;
  if (state) *state = *p;
  for (int field = 3; field < 22 && p; field++) {
    p = strchr(p, ' ');
    if (p) p++;
  }
  return p ? strtoull(p, NULL, 10) : 0;
}

/* 1 if the process recorded in the slot is gone (exited, zombie, or pid reused). */
int tp_shm_peer_dead(const rank_slot_t *s) {
  int pid = s->pid;
  if (pid <= 0) return 0;
  char state = '?';
  uint64_t st = tp_shm_proc_starttime(pid, &state);
  if (st == 0) {
    if (kill(pid, 0) == 0 || errno == EPERM) return 0;
    return errno == ESRCH;
  }
  if (state == 'Z' || state == 'X') return 1;
  return s->starttime && st != s->starttime;
}

void tp_shm_publish_abort_status(shm_ctx *c, int rank, const char *msg, tp_status_t st) {
  int32_t expect = 0;
  if (atomic_compare_exchange_strong(&c->hdr->abort_state, &expect, 1)) {
    c->hdr->abort_rank = rank;
    c->hdr->abort_status = (int32_t)st;
    snprintf(c->hdr->abort_msg, sizeof c->hdr->abort_msg, "%s", msg);
    atomic_store(&c->hdr->abort_state, 2);
  }
  /* Wake everybody who sleeps on any counter of this segment. */
  for (int p = 0; p < c->comm->size; p++) tp_shm_futex(&c->slots[p].step, FUTEX_WAKE, INT_MAX, NULL);
  for (int i = 0; i < c->comm->size * c->comm->size; i++) {
    tp_shm_futex(&c->chans[i].sent, FUTEX_WAKE, INT_MAX, NULL);
    tp_shm_futex(&c->chans[i].acked, FUTEX_WAKE, INT_MAX, NULL);
  }
}

void tp_shm_publish_abort(shm_ctx *c, int rank, const char *msg) {
  tp_shm_publish_abort_status(c, rank, msg, TP_ERR_REMOTE);
}

/* The error a rank reports when another rank aborted the communicator: a
 * timeout or mismatch keeps its kind (every rank would have seen the same),
 * anything else is a remote failure. */
tp_status_t tp_shm_abort_error(shm_ctx *c) {
  for (int i = 0; i < 1000 && atomic_load(&c->hdr->abort_state) == 1; i++) sched_yield();
  tp_status_t st = (tp_status_t)c->hdr->abort_status;
  if (st != TP_ERR_TIMEOUT && st != TP_ERR_MISMATCH) st = TP_ERR_REMOTE;
  return tp_set_error(st, "%s", c->hdr->abort_msg);
}

/* `what` names the wait in messages; NULL: the collective in progress. */
static const char *what_text(const shm_ctx *c, const char *what, char *buf, size_t n) {
  if (what) return what;
  snprintf(buf, n, "%s #%u", tp_coll_name((tp_coll_kind_t)c->cur_kind), c->cur_seq);
  return buf;
}

#define PROBE_FIRST_S 50e-6  /* first sched_yield probe of a spin */
#define PROBE_EVERY_S 200e-6 /* later probes */
/* A gap this long: another process had the core.  An interrupt or a kernel
 * thread takes microseconds to tens of them; a busy process takes a time slice
 * (0.75-3 ms). */
#define OFF_CORE_S 200e-6
#define HOLD_MIN_S 0.05
#define HOLD_MAX_S 1.0

#define REACHED(w, t) reached(atomic_load_explicit((w), memory_order_acquire), (t))

static void note_contention(shm_ctx *c, double now) {
  /* Seen again soon after the last hold ended: the load persists, hold longer. */
  if (now - c->contended_until < c->hold_s) c->hold_s = 4 * c->hold_s < HOLD_MAX_S ? 4 * c->hold_s : HOLD_MAX_S;
  else c->hold_s = HOLD_MIN_S;
  c->contended_until = now + c->hold_s;
  c->contentions++;
}

/* The adaptive spin: 1 when the word was reached, 0 when the wait should sleep. */
static int spin_adaptive(shm_ctx *c, _Atomic uint32_t *word, uint32_t target, double t0) {
  if (t0 < c->contended_until) return 0; /* contended: sleep at once */
  double last = t0, probe = t0 + PROBE_FIRST_S, end = t0 + c->spin_s;
  for (;;) {
    for (int i = 0; i < 64; i++) {
      cpu_relax();
      if (REACHED(word, target)) return 1;
    }
    double now = tp_now();
    if (now - last > OFF_CORE_S) {
      note_contention(c, now);
      return REACHED(word, target);
    }
    if (now >= end) return 0;
    if (now >= probe) {
      sched_yield();
      double after = tp_now();
      if (after - now > OFF_CORE_S) {
        note_contention(c, after);
        return REACHED(word, target);
      }
      probe = after + PROBE_EVERY_S;
      now = after;
    }
    last = now;
  }
}

tp_status_t tp_shm_wait_slow(shm_ctx *c, _Atomic uint32_t *word, _Atomic uint32_t *waiters, uint32_t target, int peer,
                             const char *what_, double max_wait) {
  if (REACHED(word, target)) return TP_SUCCESS;
  double t0;
  if (c->adaptive) {
    t0 = tp_now();
    if (c->spin_s > 0 && spin_adaptive(c, word, target, t0)) return TP_SUCCESS;
  } else {
    for (int i = 0; i < c->spin_iters; i++) {
      cpu_relax();
      if (REACHED(word, target)) return TP_SUCCESS;
    }
    t0 = tp_now();
  }
  if (c->yield_s > 0) {
    /* More ranks than cores: hand the core to the rank we wait for. */
    double y0 = tp_now();
    while (tp_now() - y0 < c->yield_s) {
      sched_yield();
      if (REACHED(word, target)) return TP_SUCCESS;
    }
  }
  double deadline = t0 + (max_wait > 0 ? max_wait : c->comm->timeout_s);
  rank_slot_t *ps = &c->slots[peer];
  for (;;) {
    if (atomic_load(&c->hdr->abort_state)) return tp_shm_abort_error(c);
    atomic_fetch_add(waiters, 1);
    uint32_t cur = atomic_load(word);
    if (!reached(cur, target)) {
      struct timespec ts = {0, 20 * 1000 * 1000};
      tp_shm_futex(word, FUTEX_WAIT, cur, &ts);
    }
    atomic_fetch_sub(waiters, 1);
    if (reached(atomic_load_explicit(word, memory_order_acquire), target)) return TP_SUCCESS;
    if (atomic_load(&c->hdr->abort_state)) return tp_shm_abort_error(c);
    double now = tp_now();
    char wbuf[64];
    const char *what = what_text(c, what_, wbuf, sizeof wbuf);
    if (atomic_load(&ps->closed)) {
      char msg[512];
      snprintf(msg, sizeof msg, "rank %d closed the communicator while rank %d waited for it in %s", peer,
               c->comm->rank, what);
      tp_shm_publish_abort(c, peer, msg);
      return tp_set_error(TP_ERR_REMOTE, "%s", msg);
    }
    if (now - c->last_liveness > 0.05) {
      c->last_liveness = now;
      if (tp_shm_peer_dead(ps)) {
        char msg[512];
        snprintf(msg, sizeof msg, "rank %d (pid %d) died while rank %d waited for it in %s", peer, ps->pid,
                 c->comm->rank, what);
        tp_shm_publish_abort(c, peer, msg);
        return tp_set_error(TP_ERR_REMOTE, "%s", msg);
      }
    }
    if (now >= deadline) {
      if (max_wait > 0) return TP_IN_PROGRESS;
      char act[512];
      tp_shm_describe_activity(c, peer, act, sizeof act);
      return tp_set_error(TP_ERR_TIMEOUT, "%s on rank %d: timed out after %.1f s waiting for rank %d: %s", what,
                          c->comm->rank, now - t0, peer, act);
    }
  }
}

void tp_shm_wait_setup(shm_ctx *c) {
  int world = c->comm->size, spin_us = c->comm->spin_us, cores = tp_shm_online_cores();
  const char *env = getenv("TPCORE_SPIN_US");
  if (spin_us < 0 && env && *env) spin_us = (int)tp_shm_env_size("TPCORE_SPIN_US", 0);
  /* Given: spin that long (a pause is ~10-50 ns), then sleep.  Else adapt (above). */
  c->adaptive = spin_us < 0;
  c->spin_iters = spin_us > 0 ? spin_us * 20 : 0;
  c->spin_s = world <= cores ? 1e-3 : 0;
  c->hold_s = HOLD_MIN_S;
  c->contended_until = 0;
  /* Measured with 3-4 ranks on 2 cores: a 100 us yield phase takes a barrier from ~25 us
   * (futex sleep and wake-up) to ~2 us; busy spinning would steal the waited-for rank's core. */
  c->yield_s = world > cores ? (double)tp_shm_env_size("TPCORE_YIELD_US", 100) * 1e-6 : 0;
}
