/*
 * shm backend: the segment and the rendezvous, the backend's table, init,
 * abort, destroy and split.
 *
 * Lifetime.  Rank 0 creates the segment (0600, O_EXCL, space reserved with
 * posix_fallocate so a full /dev/shm is an error rather than a SIGBUS) and the
 * others attach (shm_seg.c: only this user's 0600 segments, liveness by flock).
 * A name is needed only until every rank has mapped its segment (the mappings
 * keep the memory): the first rank to see them all in removes it, so a job
 * killed later, however, leaves nothing.  One exception: the world
 * communicator of a job whose id may be shared (set by hand: config
 * job_id_unique 0) keeps its name, locked by every rank, while the job lives:
 * it is the job's claim on its id, and each rank claims its place once, so a
 * second job with the same id stops both instead of mixing with them.  The last
 * rank to close removes it.  A name left by processes killed before every rank
 * was in (or, for a claim, at any time) is locked by nobody: the next world
 * communicator's sweep removes it.  Split and registered-buffer names carry a
 * fresh random number.  Rank 0's settings (chunk sizes, data-path thresholds)
 * are written in the segment and adopted by every rank: they choose data paths,
 * which must agree.
 */
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include "shm_impl.h"
#include "shm_seg.h"

size_t tp_shm_env_size(const char *name, size_t dflt) {
  const char *s = getenv(name);
  if (!s || !*s) return dflt;
  char *end;
  unsigned long long v = strtoull(s, &end, 10);
  if (end == s) return dflt;
  if (*end == 'k' || *end == 'K') v <<= 10;
  else if (*end == 'm' || *end == 'M') v <<= 20;
  return (size_t)v;
}

static uint64_t fnv1a(const char *s) {
  uint64_t h = 1469598103934665603ULL;
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ULL;
  return h;
}

/* --------------------------------------------------------- segment set-up */

static size_t layout(int world, size_t stage, size_t p2p, size_t *o_slots, size_t *o_chans, size_t *o_stage,
                     size_t *o_p2p) {
  size_t off = ALIGN_UP(sizeof(shm_header_t), 4096);
  *o_slots = off;
  off += ALIGN_UP(sizeof(rank_slot_t) * (size_t)world, 4096);
  *o_chans = off;
  off += ALIGN_UP(sizeof(chan_t) * (size_t)world * (size_t)world, 4096);
  *o_stage = off;
  off += (size_t)world * 2 * stage;
  *o_p2p = off;
  off += world > 1 ? (size_t)world * (size_t)world * P2P_NBUF * p2p : 0;
  return ALIGN_UP(off, 4096);
}

/* Random bits for names nobody may predict. */
uint64_t tp_shm_random_token(void) {
  uint64_t t = 0;
  if (getrandom(&t, sizeof t, 0) == (ssize_t)sizeof t && t) return t;
  return (uint64_t)tp_now() * 0x9E3779B97F4A7C15ULL ^ (uint64_t)getpid() << 32 ^ (uint64_t)(uintptr_t)&t;
}

/* Why two jobs meet in one segment, and what to do about it. */
#define COLLISION_ADVICE                                                              \
  "; both jobs stop. Give each job a job id of its own: python -m tpcore.launch and " \
  "tpcore.spawn do; with torchrun-style variables set TPCORE_JOB_ID, or another MASTER_PORT"

/* Rank 0 found its segment's name taken.  A name no process locks is left from a
 * job that died: remove it (*retry).  A communicator of this id being closed: wait
 * for its last rank to leave, which removes the name (*retry).  Any other live one
 * belongs to another job with the same id: tell that job (both stop) and fail. */
static tp_status_t name_taken(shm_ctx *c, double deadline, int *retry) {
  int fd;
  size_t nb = 0;
  *retry = 0;
  TP_CHECK(tp_seg_open(c->name, &fd, &nb)); /* another user's or a loosened one: an error */
  if (fd < 0) {
    *retry = 1; /* gone meanwhile */
    return TP_SUCCESS;
  }
  if (flock(fd, LOCK_EX | LOCK_NB) == 0) { /* held through the check and the unlink */
    if (tp_seg_same(c->name, fd)) shm_unlink(c->name);
    close(fd);
    *retry = 1;
    return TP_SUCCESS;
  }
  shm_header_t *h = nb >= sizeof *h ? mmap(NULL, sizeof *h, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  close(fd);
  int ready = h != MAP_FAILED && __atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) == SHM_MAGIC;
  int mine = ready && h->creator_pid == getpid() && h->creator_start == tp_shm_proc_starttime(getpid(), NULL);
  /* Passing: still being set up by the process that holds it (it sets the magic
   * within microseconds), a communicator of this id being closed, or the name of
   * a job of one rank, which goes as soon as its rank is in (jobs of one rank
   * have nobody to mix with, so they may share an id).  Look again shortly. */
  int setting_up = !ready;
  int closing = ready && (atomic_load(&h->closing) || atomic_load(&h->abort_state));
  int solo = ready && !mine && h->world == 1 && c->comm->size == 1;
  if (setting_up || closing || solo) {
    if (h != MAP_FAILED) munmap(h, sizeof *h);
    if (tp_now() > deadline) {
      if (closing)
        return tp_set_error(TP_ERR_TIMEOUT,
                            "rank 0 timed out waiting for the previous communicator of job '%s' to be "
                            "closed by all its ranks (shared-memory segment %s is still in use)",
                            c->comm->job_id, c->name);
      return tp_set_error(TP_ERR_TIMEOUT,
                          "rank 0 timed out waiting for shared-memory segment %s of job '%s', held by "
                          "another process, to be %s",
                          c->name, c->comm->job_id, setting_up ? "set up" : "released by its job of one rank");
    }
    usleep(1000);
    *retry = 1;
    return TP_SUCCESS;
  }
  if (mine) {
    munmap(h, sizeof *h);
    return tp_set_error(TP_ERR_INVALID_USAGE,
                        "this process already has a communicator of job '%s' (shared-memory segment %s): "
                        "close it before making another, or use another TPCORE_JOB_ID",
                        c->comm->job_id, c->name);
  }
  char msg[768];
  snprintf(msg, sizeof msg,
           "job id '%s' is used by two jobs at once: rank 0 of a second job (pid %d) found the "
           "running job's shared-memory segment %s (created by pid %d)" COLLISION_ADVICE,
           c->comm->job_id, (int)getpid(), c->name, ready ? h->creator_pid : -1);
  if (ready) { /* the other job's ranks see it at their next call or within 20 ms of waiting */
    int32_t expect = 0;
    if (atomic_compare_exchange_strong(&h->abort_state, &expect, 1)) {
      h->abort_rank = 0;
      h->abort_status = (int32_t)TP_ERR_INVALID_USAGE;
      snprintf(h->abort_msg, sizeof h->abort_msg, "%s", msg);
      atomic_store(&h->abort_state, 2);
    }
  }
  if (h != MAP_FAILED) munmap(h, sizeof *h);
  return tp_set_error(TP_ERR_INVALID_USAGE, "%s", msg);
}

static void free_ctx(shm_ctx *c) {
  if (!c) return;
  pthread_mutex_destroy(&c->regions_lock);
  free(c->scratch);
  free(c->p2p_sent);
  free(c->p2p_recvd);
  free(c->p2p_msg_s);
  free(c->p2p_msg_r);
  free(c);
}

static void shm_destroy(struct tp_comm *comm);
static void shm_abort(struct tp_comm *comm, const char *reason);
static tp_status_t shm_split(struct tp_comm *comm, int color, int key, struct tp_comm **out);

static void shm_stats(struct tp_comm *comm, tp_comm_stats_t *stats) {
  const shm_ctx *c = comm->impl;
  stats->single_copy = c ? c->use_cma : 0;
}

static const tp_backend_ops shm_ops = {
    .name = "shm",
    .devices = 1u << TP_DEVICE_CPU,
    .streams = 0,
    .collective = tp_shm_collective,
    .send = tp_shm_send,
    .recv = tp_shm_recv,
    .sendrecv = tp_shm_sendrecv,
    .split = shm_split,
    .mem_alloc = tp_shm_mem_alloc,
    .stats = shm_stats,
    .abort = shm_abort,
    .destroy = shm_destroy,
};

int tp_shm_online_cores(void) {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (int)n : 1;
}

/* Join the segment rank 0 creates: wait for it (up to the deadline), never join a
 * stale one (its creator gone) or one of another user, adopt rank 0's settings,
 * check that the layout they give is the segment's size, and take this rank's
 * lock on it (c->lock_fd). */
static tp_status_t attach_main(shm_ctx *c, int world, int rank, double deadline, void **base, size_t *size,
                               size_t *o_slots, size_t *o_chans, size_t *o_stage, size_t *o_p2p) {
  const char *why = "it does not exist yet";
  for (;; usleep(1000)) {
    if (tp_now() > deadline)
      return tp_set_error(TP_ERR_TIMEOUT,
                          "rank %d timed out waiting for rank 0 to create shared-memory segment %s (%s; "
                          "did rank 0 start, with the same job id and world size?)",
                          rank, c->name, why);
    int fd;
    size_t nb = 0;
    TP_CHECK(tp_seg_open(c->name, &fd, &nb)); /* another user's or a loosened one: never joined */
    if (fd < 0) continue;
    if (nb < sizeof(shm_header_t)) {
      close(fd);
      why = "it is still being sized";
      continue;
    }
    shm_header_t *h = mmap(NULL, sizeof *h, PROT_READ, MAP_SHARED, fd, 0);
    if (h == MAP_FAILED) {
      int err = errno;
      close(fd);
      return tp_seg_sys_error("cannot map shared-memory segment", c->name, err);
    }
    int ready = __atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) == SHM_MAGIC;
    rank_slot_t probe = {0};
    if (ready) {
      probe.pid = h->creator_pid;
      probe.starttime = h->creator_start;
    }
    int ending = ready && (atomic_load(&h->closing) || atomic_load(&h->abort_state));
    if (!ready || ending || tp_shm_peer_dead(&probe)) {
      why = !ready   ? "it is not initialised yet"
            : ending ? "the segment found belongs to a communicator being closed"
                     : "the segment found belongs to a job that ended";
      munmap(h, sizeof *h);
      close(fd);
      continue;
    }
    if (h->version != SHM_VERSION || h->world != world) {
      tp_status_t st = tp_set_error(TP_ERR_INVALID_USAGE,
                                    "rank %d: shared-memory segment %s was set up by rank 0 for world size %d "
                                    "(version %u), but this rank has world size %d (version %d)",
                                    rank, c->name, h->world, h->version, world, SHM_VERSION);
      munmap(h, sizeof *h);
      close(fd);
      return st;
    }
    c->stage_bytes = h->stage_bytes;
    c->p2p_chunk = h->p2p_chunk;
    c->small_bytes = h->small_bytes;
    c->nt_bytes = h->nt_bytes;
    c->scratch_blk = h->scratch_blk;
    memcpy(c->cma_bytes, h->cma_bytes, sizeof c->cma_bytes);
    munmap(h, sizeof *h);
    if (!tp_seg_lock(c->name, fd)) { /* removed after we opened it: look again */
      close(fd);
      continue;
    }
    *size = layout(world, c->stage_bytes, c->p2p_chunk, o_slots, o_chans, o_stage, o_p2p);
    if (*size != nb) {
      tp_seg_close(fd);
      return tp_set_error(TP_ERR_INTERNAL, "rank %d: shared-memory segment %s has %zu bytes, expected %zu", rank,
                          c->name, nb, *size);
    }
    void *p = tp_seg_map(fd, *size);
    if (p == MAP_FAILED) {
      int err = errno;
      tp_seg_close(fd);
      return tp_seg_sys_error("cannot map shared-memory segment", c->name, err);
    }
    c->lock_fd = fd;
    *base = p;
    return TP_SUCCESS;
  }
}

/* A communicator's context with its tunables (TPCORE_SHM_*); NULL with the error set. */
static shm_ctx *ctx_new(struct tp_comm *comm, const char *comm_id, int world_comm) {
  int world = comm->size;
  shm_ctx *c = calloc(1, sizeof *c);
  if (!c) {
    tp_set_error(TP_ERR_NOMEM, "out of memory");
    return NULL;
  }
  c->comm = comm;
  /* Only a world communicator whose job id may be shared keeps its name (the claim); a
   * world of one rank has no one to mix with: its name goes at once like a split's. */
  c->keep_name = world_comm && world > 1 && !comm->job_id_unique;
  c->lock_fd = -1;
  pthread_mutex_init(&c->regions_lock, NULL);
  snprintf(c->comm_id, sizeof c->comm_id, "%s", comm_id);
  snprintf(c->name, sizeof c->name, "/tpcore_%s_%016llx", comm->job_id, (unsigned long long)fnv1a(comm_id));
  c->stage_bytes = ALIGN_UP(tp_shm_env_size("TPCORE_SHM_CHUNK", (size_t)1 << 20), 4096);
  if (c->stage_bytes < 65536) c->stage_bytes = 65536;
  /* The channels take world^2 * 2 chunks: keep them to ~8 MiB for large worlds. */
  size_t p2p_dflt = ((size_t)4 << 20) / ((size_t)world * (size_t)world);
  p2p_dflt = p2p_dflt > ((size_t)256 << 10) ? ((size_t)256 << 10) : p2p_dflt < 16384 ? 16384 : p2p_dflt;
  c->p2p_chunk = ALIGN_UP(tp_shm_env_size("TPCORE_SHM_P2P_CHUNK", p2p_dflt), 4096);
  c->small_bytes = tp_shm_env_size("TPCORE_SHM_SMALL", (size_t)32 << 10);
  if (c->small_bytes > c->stage_bytes) c->small_bytes = c->stage_bytes;
  /* Non-temporal stores measured slower on these machines at every size: opt-in. */
  c->nt_bytes = tp_shm_env_size("TPCORE_SHM_NT_BYTES", SIZE_MAX);
  /* Measured on 2 ranks with buffers rewritten between calls: the kernel's copy reads
   * lines dirty in the peer's cache at ~10 GB/s, so the two pull phases of all_reduce
   * and reduce_scatter beat staging only from a few MiB; one-copy gathers win from 64 KiB. */
  c->cma_bytes[TP_COLL_ALL_GATHER] = c->cma_bytes[TP_COLL_BROADCAST] = (size_t)64 << 10;
  c->cma_bytes[TP_COLL_ALL_TO_ALL] = (size_t)64 << 10; /* a rank's whole send buffer */
  c->cma_bytes[TP_COLL_ALL_REDUCE] = (size_t)2 << 20;
  c->cma_bytes[TP_COLL_REDUCE_SCATTER] = (size_t)2 << 20;
  if (getenv("TPCORE_SHM_CMA_BYTES"))
    for (int k = 0; k < TP_COLL_NUM; k++) c->cma_bytes[k] = tp_shm_env_size("TPCORE_SHM_CMA_BYTES", 0);
  c->scratch_blk = ALIGN_UP(tp_shm_env_size("TPCORE_SHM_CMA_BLOCK", (size_t)128 << 10), 4096);
  tp_shm_wait_setup(c);
  c->p2p_sent = calloc((size_t)world, sizeof(uint32_t));
  c->p2p_recvd = calloc((size_t)world, sizeof(uint32_t));
  c->p2p_msg_s = calloc((size_t)world, sizeof(uint32_t));
  c->p2p_msg_r = calloc((size_t)world, sizeof(uint32_t));
  if (!c->p2p_sent || !c->p2p_recvd || !c->p2p_msg_s || !c->p2p_msg_r) {
    free_ctx(c);
    tp_set_error(TP_ERR_NOMEM, "out of memory");
    return NULL;
  }
  return c;
}

/* Rank 0: creates the segment (a name left by a job that died is swept or waited out)
 * and writes its header, the magic last. */
static tp_status_t create_main(shm_ctx *c, int world_comm, size_t size, double deadline, void **base) {
  /* The user's names that no live process locks are left from jobs that died
   * (SIGKILL during set-up, or a world communicator's name): remove them. */
  if (world_comm) tp_seg_sweep(TP_SEG_PREFIX);
  tp_status_t st;
  for (;;) {
    int exists = 0, retry = 0;
    st = tp_seg_create(c->name, size, base, &c->lock_fd, &exists);
    if (!exists) break;
    st = name_taken(c, deadline, &retry);
    if (st == TP_SUCCESS && !retry) st = tp_set_error(TP_ERR_INTERNAL, "segment %s: no decision", c->name);
    if (st == TP_SUCCESS && tp_now() > deadline)
      st = tp_set_error(TP_ERR_TIMEOUT, "cannot create shared-memory segment %s: its name keeps coming back", c->name);
    if (st != TP_SUCCESS) break;
  }
  if (st != TP_SUCCESS) return st;
  shm_header_t *h = *base;
  h->world = c->comm->size;
  h->total_size = size;
  h->stage_bytes = c->stage_bytes;
  h->p2p_chunk = c->p2p_chunk;
  h->small_bytes = c->small_bytes;
  h->nt_bytes = c->nt_bytes;
  h->scratch_blk = c->scratch_blk;
  memcpy(h->cma_bytes, c->cma_bytes, sizeof h->cma_bytes);
  h->creator_pid = getpid();
  h->creator_start = tp_shm_proc_starttime(getpid(), NULL);
  h->version = SHM_VERSION;
  atomic_store(&h->attached, 0);
  __atomic_store_n(&h->magic, SHM_MAGIC, __ATOMIC_RELEASE);
  return TP_SUCCESS;
}

/* This rank's place in the segment, claimed once.  A second claimant is a rank of another
 * job that has the same job id (two torchrun-style jobs on one address and port): both
 * jobs stop, rather than compute with each other's ranks. */
static tp_status_t claim_place(shm_ctx *c, int rank) {
  rank_slot_t *me = &c->slots[rank];
  int32_t holder = 0;
  uint64_t my_start = tp_shm_proc_starttime(getpid(), NULL);
  if (!atomic_compare_exchange_strong(&me->pid, &holder, (int32_t)getpid())) {
    char msg[768];
    snprintf(msg, sizeof msg,
             "job id '%s' is used by two jobs at once: rank %d's place in shared-memory segment %s "
             "was already taken by pid %d when pid %d arrived" COLLISION_ADVICE,
             c->comm->job_id, rank, c->name, (int)holder, (int)getpid());
    tp_shm_publish_abort_status(c, rank, msg, TP_ERR_INVALID_USAGE);
    return tp_set_error(TP_ERR_INVALID_USAGE, "%s", msg);
  }
  me->starttime = my_start;
  c->cma_magic = 0x54504d4100000000ULL | (uint64_t)rank;
  me->cma_probe = (uint64_t)(uintptr_t)&c->cma_magic;
  atomic_store(&me->act_kind, TP_COLL_NONE);
  atomic_fetch_add(&c->hdr->attached, 1);
  return TP_SUCCESS;
}

/* Waits for every rank to attach (an abort, a dead peer and the deadline end the wait). */
static tp_status_t wait_attached(shm_ctx *c, int world, int rank, double deadline) {
  for (;;) {
    int n = atomic_load(&c->hdr->attached);
    if (n >= world) return TP_SUCCESS;
    if (atomic_load(&c->hdr->abort_state)) return tp_shm_abort_error(c);
    if (tp_now() > deadline) {
      char missing[256] = "";
      size_t len = 0;
      for (int p = 0; p < world && len < sizeof missing - 16; p++)
        if (c->slots[p].pid == 0) len += snprintf(missing + len, sizeof missing - len, "%s%d", len ? ", " : "", p);
      return tp_set_error(TP_ERR_TIMEOUT,
                          "rank %d timed out after %.1f s waiting for rank(s) %s to join the "
                          "communicator (%d of %d joined)",
                          rank, c->comm->timeout_s, missing, n, world);
    }
    for (int p = 0; p < world; p++) {
      if (p != rank && c->slots[p].pid && tp_shm_peer_dead(&c->slots[p]))
        return tp_set_error(TP_ERR_REMOTE, "rank %d (pid %d) died while the communicator was being set up", p,
                            c->slots[p].pid);
    }
    usleep(world <= tp_shm_online_cores() ? 50 : 500);
  }
}

/* Single-copy transfers need every rank to be able to read every other's memory (same
 * user, and ptrace rules such as Yama's allowing it): tested once, agreed by all ranks. */
static tp_status_t setup_cma(shm_ctx *c, int world, int rank) {
  int cma_ok = world > 1 && tp_shm_env_size("TPCORE_SHM_CMA", 1) != 0;
  for (int p = 0; p < world && cma_ok; p++) {
    if (p == rank) continue;
    uint64_t v = 0;
    struct iovec l = {&v, sizeof v}, r = {(void *)(uintptr_t)c->slots[p].cma_probe, sizeof v};
    if (process_vm_readv(c->slots[p].pid, &l, 1, &r, 1, 0) != (ssize_t)sizeof v ||
        v != (0x54504d4100000000ULL | (uint64_t)p))
      cma_ok = 0;
  }
  atomic_store(&c->slots[rank].cma_ok, cma_ok);
  TP_CHECK(shm_sync_all(c, "init"));
  c->use_cma = 1;
  for (int p = 0; p < world; p++) c->use_cma &= atomic_load(&c->slots[p].cma_ok) != 0;
  if (c->use_cma) {
    c->scratch = malloc((size_t)(world - 1) * c->scratch_blk);
    if (!c->scratch) { /* every rank must agree: fail instead */
      c->use_cma = 0;
      return tp_set_error(TP_ERR_NOMEM, "out of memory for the communicator's scratch space");
    }
  }
  return TP_SUCCESS;
}

tp_status_t tp_shm_comm_init(struct tp_comm *comm, const char *comm_id, int world_comm) {
  int world = comm->size, rank = comm->rank;
  shm_ctx *c = ctx_new(comm, comm_id, world_comm);
  if (!c) return tp_last_status();
  size_t o_slots, o_chans, o_stage, o_p2p;
  size_t size = layout(world, c->stage_bytes, c->p2p_chunk, &o_slots, &o_chans, &o_stage, &o_p2p);
  double deadline = tp_now() + comm->timeout_s;
  void *base = NULL;
  tp_status_t st = rank == 0
                       ? create_main(c, world_comm, size, deadline, &base)
                       : attach_main(c, world, rank, deadline, &base, &size, &o_slots, &o_chans, &o_stage, &o_p2p);
  if (st != TP_SUCCESS) {
    free_ctx(c);
    return st;
  }
  c->base = base;
  c->size = size;
  c->hdr = base;
  c->slots = (rank_slot_t *)(c->base + o_slots);
  c->chans = (chan_t *)(c->base + o_chans);
  c->stage = c->base + o_stage;
  c->p2pdata = c->base + o_p2p;
  st = claim_place(c, rank);
  if (st != TP_SUCCESS) goto fail_unclaimed;
  comm->impl = c;
  comm->ops = &shm_ops;
  st = wait_attached(c, world, rank, deadline); /* then the name can go */
  if (st != TP_SUCCESS) goto fail;
  if (!c->keep_name) {
    /* Everyone has mapped it: the first rank here removes the name (the last to attach
     * sees everyone at once).  No other segment can take the name before every rank
     * has passed here: nobody else knows it, and a next communicator of this id needs
     * every rank past setup_cma's round below. */
    if (tp_seg_same(c->name, c->lock_fd)) shm_unlink(c->name);
    tp_seg_close(c->lock_fd);
    c->lock_fd = -1;
  }
  st = setup_cma(c, world, rank);
  if (st != TP_SUCCESS) goto fail;
  return TP_SUCCESS;
fail:
  atomic_store(&c->hdr->closing, 1);
fail_unclaimed:
  tp_seg_leave(c->name, c->lock_fd); /* the last one out removes the name */
  munmap(c->base, c->size);
  free_ctx(c);
  comm->impl = NULL;
  comm->ops = NULL;
  return st;
}

static void shm_abort(struct tp_comm *comm, const char *reason) {
  shm_ctx *c = comm->impl;
  if (!c) return;
  char msg[768];
  snprintf(msg, sizeof msg, "rank %d aborted the communicator: %s", comm->rank,
           reason && *reason ? reason : "(no reason given)");
  tp_shm_publish_abort(c, comm->rank, msg);
}

static void shm_destroy(struct tp_comm *comm) {
  shm_ctx *c = comm->impl;
  if (!c) return;
  rank_slot_t *me = &c->slots[comm->rank];
  atomic_store(&me->closed, 1);
  atomic_store(&c->hdr->closing, 1); /* a new communicator of this id waits for this one to go */
  tp_shm_futex(&me->step, FUTEX_WAKE, INT_MAX, NULL);
  for (int p = 0; p < comm->size; p++) {
    tp_shm_futex(&chan(c, comm->rank, p)->sent, FUTEX_WAKE, INT_MAX, NULL);
    tp_shm_futex(&chan(c, p, comm->rank)->acked, FUTEX_WAKE, INT_MAX, NULL);
  }
  pthread_mutex_lock(&c->regions_lock);
  shm_mem *m = c->regions;
  c->regions = NULL;
  pthread_mutex_unlock(&c->regions_lock);
  while (m) {
    shm_mem *next = m->next;
    m->owner = NULL;
    m->next = NULL;
    m->hdr.release(&m->hdr);
    m = next;
  }
  munmap(c->base, c->size);
  tp_seg_leave(c->name, c->lock_fd); /* the last one out removes a world communicator's name */
  free_ctx(c);
  comm->impl = NULL;
}

/* -------------------------------------------------------------- split */

static tp_status_t shm_split(struct tp_comm *comm, int color, int key, struct tp_comm **out) {
  shm_ctx *c = comm->impl;
  RETURN_IF_ABORTED(c);
  int n = comm->size, r = comm->rank;
  char what[48];
  c->seq++;
  snprintf(what, sizeof what, "split #%u", c->seq);
  shm_set_activity(c, TP_COLL_SPLIT, c->seq, -1);
  tp_coll_args_t a = {TP_COLL_SPLIT, NULL, NULL, 0, NULL, 0, TP_UINT8, TP_SUM, 0, NULL, NULL};
  tp_shm_post_hdr(c, &a, color, key, -1, 0, -1, 0);
  if (r == 0) c->slots[0].hdr[c->seq & 1].nonce = tp_shm_random_token();
  tp_status_t st = shm_sync_all(c, what);
  if (st == TP_SUCCESS) st = tp_shm_check_hdrs(c, &a);
  unsigned nsplit = c->nsplit++;
  uint64_t nonce = c->slots[0].hdr[c->seq & 1].nonce;
  int newsize = 0, newrank = 0;
  if (st == TP_SUCCESS && color != TP_SPLIT_NOCOLOR) {
    for (int p = 0; p < n; p++) {
      const coll_hdr_t *h = &c->slots[p].hdr[c->seq & 1];
      if (h->color != color) continue;
      newsize++;
      if (h->key < key || (h->key == key && p < r)) newrank++;
    }
  }
  /* Everyone has read the headers before anyone can overwrite them. */
  if (st == TP_SUCCESS) st = shm_sync_all(c, what);
  atomic_store_explicit(&c->slots[r].last_start, comm->call_t0, memory_order_relaxed);
  atomic_store(&c->slots[r].last_seq, c->seq);
  shm_set_activity(c, TP_COLL_NONE, c->seq, -1);
  if (st != TP_SUCCESS || color == TP_SPLIT_NOCOLOR) return st;
  struct tp_comm *nc;
  TP_CHECK(tp_comm_alloc_common(&nc, newsize, newrank, comm->job_id, comm->timeout_s, comm->spin_us));
  char id[96];
  /* A fresh random number of rank 0's, published through the job's own segment just
   * before the new segments are made, keeps their names unpredictable. */
  snprintf(id, sizeof id, "%016llx.%016llx.%u.%d", (unsigned long long)nonce, (unsigned long long)fnv1a(c->comm_id),
           nsplit, color);
  st = tp_shm_comm_init(nc, id, 0);
  if (st != TP_SUCCESS) {
    tp_error_prefix("split (color %d) on rank %d", color, r);
    free(nc);
    return st;
  }
  *out = nc;
  return TP_SUCCESS;
}
