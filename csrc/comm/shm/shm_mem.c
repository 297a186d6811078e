/*
 * shm backend: registered memory (NCCL's user-buffer registration).  A
 * registered allocation is one shared-memory mapping with a slot per rank
 * (rank p's buffer at p * slot), mapped by every rank; collectives whose
 * buffers all lie at the same offset of it read and write the peers' slots in
 * place.  A handle (shm_mem, starting with the common struct tp_mem header)
 * holds two references, the communicator's and the caller's (tp_mem_release);
 * the mapping goes with the last, so a buffer outlives its communicator.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "shm_impl.h"
#include "shm_seg.h"

int64_t tp_shm_find_region(shm_ctx *c, const void *p, size_t nbytes, int64_t *off) {
  if (!p || !c->regions) return -1;
  int64_t id = -1;
  pthread_mutex_lock(&c->regions_lock);
  for (shm_mem *m = c->regions; m; m = m->next) {
    const char *lo = (const char *)m->ptr;
    if ((const char *)p >= lo && (const char *)p + nbytes <= lo + m->nbytes) {
      *off = (const char *)p - lo;
      id = m->id;
      break;
    }
  }
  pthread_mutex_unlock(&c->regions_lock);
  return id;
}

shm_mem *tp_shm_region_by_id(shm_ctx *c, int64_t id) {
  shm_mem *found = NULL;
  pthread_mutex_lock(&c->regions_lock);
  for (shm_mem *m = c->regions; m; m = m->next)
    if (m->id == id) {
      found = m;
      break;
    }
  pthread_mutex_unlock(&c->regions_lock);
  return found;
}

/* The handle's release (tp_mem_release): one reference is the caller's, one the
 * communicator's; the mapping goes with the last. */
static void shm_mem_release(struct tp_mem *h) {
  shm_mem *m = (shm_mem *)h;
  shm_ctx *c = m->owner;
  if (c) { /* still registered: unlink from the communicator's list */
    int found = 0;
    pthread_mutex_lock(&c->regions_lock);
    shm_mem **pp = &c->regions;
    while (*pp && *pp != m) pp = &(*pp)->next;
    if (*pp) {
      *pp = m->next;
      m->owner = NULL;
      m->next = NULL;
      found = 1;
    }
    pthread_mutex_unlock(&c->regions_lock);
    if (found && atomic_fetch_sub(&m->refs, 1) == 1) goto unmap;
  }
  if (atomic_fetch_sub(&m->refs, 1) != 1) return;
unmap:
  munmap(m->base, m->maplen);
  free(m);
}

/* Map a registered buffer rank 0 has created: exactly its size, this user's, 0600. */
static tp_status_t attach_region(const char *name, size_t size, void **base) {
  int fd;
  size_t nb = 0;
  TP_CHECK(tp_seg_open(name, &fd, &nb));
  if (fd < 0) return tp_set_error(TP_ERR_SYSTEM, "shared-memory segment %s is gone", name);
  if (nb != size) {
    close(fd);
    return tp_set_error(TP_ERR_SYSTEM, "shared-memory segment %s has %zu bytes, expected %zu", name, nb, size);
  }
  void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  if (p == MAP_FAILED) return tp_seg_sys_error("cannot map shared-memory segment", name, err);
  *base = p;
  return TP_SUCCESS;
}

tp_status_t tp_shm_mem_alloc(struct tp_comm *comm, size_t nbytes, void **ptr, tp_mem_t *out) {
  shm_ctx *c = comm->impl;
  RETURN_IF_ABORTED(c);
  int n = comm->size, r = comm->rank;
  char what[48];
  c->seq++;
  snprintf(what, sizeof what, "alloc #%u", c->seq);
  shm_set_activity(c, TP_COLL_ALLOC, c->seq, -1);
  tp_coll_args_t a = {TP_COLL_ALLOC, NULL, NULL, nbytes, NULL, nbytes, TP_UINT8, TP_SUM, 0, NULL, NULL};
  tp_shm_post_hdr(c, &a, 0, 0, -1, 0, -1, 0);
  if (r == 0) c->slots[0].hdr[c->seq & 1].nonce = tp_shm_random_token();
  tp_status_t st = shm_sync_all(c, what);
  if (st == TP_SUCCESS) st = tp_shm_check_hdrs(c, &a);
  if (st != TP_SUCCESS) goto done;
  int64_t id = c->nmem++;
  size_t slot = ALIGN_UP(nbytes ? nbytes : 1, 4096);
  size_t maplen = slot * (size_t)n;
  char name[300];
  /* Not predictable: a fresh random number of rank 0's, published through the job's
   * own segment just before the name is made, so nobody can create it first. */
  snprintf(name, sizeof name, "%s_%016llx_m%lld", c->name, (unsigned long long)c->slots[0].hdr[c->seq & 1].nonce,
           (long long)id);
  void *base = NULL;
  int lock_fd = -1;
  tp_status_t mine = TP_SUCCESS;
  char myerr[512] = "";
  rank_slot_t *ms = &c->slots[r];
  if (r == 0) {
    int exists = 0;
    mine = tp_seg_create(name, maplen, &base, &lock_fd, &exists);
    if (exists) { /* name the owner when it is someone else's */
      int ofd;
      size_t onb;
      mine = tp_seg_open(name, &ofd, &onb);
      if (ofd >= 0) close(ofd);
      if (mine == TP_SUCCESS) mine = tp_set_error(TP_ERR_INVALID_USAGE, "shared-memory name %s exists already", name);
    }
    if (mine != TP_SUCCESS) snprintf(myerr, sizeof myerr, "%s", tp_last_error());
    atomic_store(&ms->status, (int32_t)mine);
    st = shm_sync_all(c, what); /* created (or failed) */
  } else {
    shm_arrive(c);
    st = shm_wait_word(c, &c->slots[0].step, &c->slots[0].waiters, c->step, 0, what, 0);
    if (st == TP_SUCCESS && atomic_load(&c->slots[0].status) == TP_SUCCESS) {
      mine = attach_region(name, maplen, &base);
      if (mine != TP_SUCCESS) snprintf(myerr, sizeof myerr, "%s", tp_last_error());
    } else if (st == TP_SUCCESS) {
      mine = TP_ERR_NOMEM;
      snprintf(myerr, sizeof myerr, "rank 0 could not create the shared buffer");
    }
    atomic_store(&ms->status, (int32_t)mine);
    if (st == TP_SUCCESS) st = shm_wait_all(c, what);
  }
  if (st == TP_SUCCESS) st = shm_sync_all(c, what); /* everyone attached (or failed) */
  if (lock_fd >= 0) {                               /* rank 0: everyone is in (or failed); the name can go */
    if (tp_seg_same(name, lock_fd)) shm_unlink(name);
    tp_seg_close(lock_fd);
  }
  if (st != TP_SUCCESS) {
    if (base) munmap(base, maplen);
    goto done;
  }
  int bad = -1;
  for (int p = 0; p < n && bad < 0; p++)
    if (atomic_load(&c->slots[p].status) != TP_SUCCESS) bad = p;
  /* Statuses are read; one more round before anyone may overwrite them. */
  st = shm_sync_all(c, what);
  if (st != TP_SUCCESS) {
    if (base) munmap(base, maplen);
    goto done;
  }
  if (bad >= 0) {
    if (base) munmap(base, maplen);
    if (bad == r) st = tp_set_error(TP_ERR_NOMEM, "alloc of %zu bytes on rank %d: %s", nbytes, r, myerr);
    else st = tp_set_error(TP_ERR_NOMEM, "alloc of %zu bytes failed on rank %d", nbytes, bad);
    goto done;
  }
  shm_mem *m = calloc(1, sizeof *m);
  if (!m) {
    munmap(base, maplen);
    st = tp_set_error(TP_ERR_NOMEM, "out of memory");
    goto done;
  }
  m->hdr.release = shm_mem_release;
  atomic_init(&m->refs, 2); /* the communicator's and the caller's */
  m->base = base;
  m->maplen = maplen;
  m->slot = slot;
  m->id = id;
  m->rank = r;
  m->ptr = (char *)base + (size_t)r * slot;
  m->nbytes = nbytes;
  m->owner = c;
  pthread_mutex_lock(&c->regions_lock);
  m->next = c->regions;
  c->regions = m;
  pthread_mutex_unlock(&c->regions_lock);
  *ptr = m->ptr;
  *out = &m->hdr;
done:
  atomic_store_explicit(&c->slots[r].last_start, comm->call_t0, memory_order_relaxed);
  atomic_store(&c->slots[r].last_seq, c->seq);
  shm_set_activity(c, TP_COLL_NONE, c->seq, -1);
  return st;
}
