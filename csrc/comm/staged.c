/*
 * The host-staged path: a device buffer given to a backend that runs on the host
 * (shm).  When the buffer's device has a table that can copy to the host, the
 * dispatcher stages the call: device -> host copies on the caller's stream, a
 * sync, the host call on host buffers, host -> device copies, a sync.  So several
 * ranks on GPUs (several on one GPU, where NCCL cannot run them) still work over
 * shm.  Generic over device types: it uses the device table only.
 *
 * The host buffers are plain heap memory (the device table has no pinned
 * allocation yet).  In-place calls stay in place: a buffer inside another (the
 * in-place all_gather / reduce_scatter forms, or send == recv) is staged inside
 * the other's host copy.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm_impl.h"
#include "staged_impl.h"
#include "tpcore/device.h"

int tp_comm_stage_needed(tp_comm_t c, const void *p) {
  if (!p || c->ops->streams) return 0;
  tp_device_t d;
  int id;
  tp_pointer_device(p, &d, &id);
  if ((unsigned)d < 32 && (c->ops->devices & (1u << d))) return 0;
  return tp_device_ops_of(d) != NULL;
}

/* Where the device buffers live: the device of whichever is off the host. */
static void device_of(const void *a, const void *b, tp_device_t *d, int *id) {
  tp_pointer_device(a, d, id);
  if (*d == TP_DEVICE_CPU && b) tp_pointer_device(b, d, id);
}

typedef struct {
  const void *dev;  /* the caller's pointer */
  size_t bytes;
  char *host;       /* its host copy (inside `owner`'s when nested) */
  int staged, owned;
} stage_t;

/* inner lies within outer: [inner, inner + ib) inside [outer, outer + ob). */
static int inside(const void *inner, size_t ib, const void *outer, size_t ob) {
  const char *i = inner, *o = outer;
  return i && o && i >= o && ib <= ob && (size_t)(i - o) <= ob - ib;
}

static tp_status_t fail(tp_comm_t c, const char *op, tp_status_t st) {
  char msg[900];
  snprintf(msg, sizeof msg, "%s", tp_last_error());
  /* The peers are (or will be) in the host call: fail them now rather than at their timeout. */
  tp_comm_abort(c, msg);
  return tp_set_error(st, "%s on rank %d of %d (staged through host memory): %s", op, c->rank, c->size, msg);
}

tp_status_t tp_comm_staged(tp_comm_t c, tp_coll_args_t *a, size_t sbytes, size_t rbytes, int used_send,
                           int used_recv, tp_stream_t stream, tp_status_t (*run)(tp_comm_t, tp_coll_args_t *)) {
  const char *op = tp_coll_name(a->kind);
  tp_device_t d;
  int id;
  device_of(used_send ? a->send : NULL, used_recv ? a->recv : NULL, &d, &id);
  if (d == TP_DEVICE_CPU) device_of(a->send, a->recv, &d, &id);
  stage_t s = {a->send, sbytes, NULL, used_send && tp_comm_stage_needed(c, a->send), 0};
  stage_t r = {a->recv, rbytes, NULL, used_recv && tp_comm_stage_needed(c, a->recv), 0};
  /* The host buffers; a nested one shares its container's. */
  if (r.staged && s.staged && inside(s.dev, sbytes, r.dev, rbytes)) {
    r.host = malloc(rbytes ? rbytes : 1), r.owned = 1;
    if (r.host) s.host = r.host + ((const char *)s.dev - (const char *)r.dev);
  } else if (r.staged && s.staged && inside(r.dev, rbytes, s.dev, sbytes)) {
    s.host = malloc(sbytes ? sbytes : 1), s.owned = 1;
    if (s.host) r.host = s.host + ((const char *)r.dev - (const char *)s.dev);
  } else {
    if (s.staged) s.host = malloc(sbytes ? sbytes : 1), s.owned = 1;
    if (r.staged) r.host = malloc(rbytes ? rbytes : 1), r.owned = 1;
  }
  tp_status_t st = TP_SUCCESS;
  if ((s.staged && !s.host) || (r.staged && !r.host))
    st = tp_set_error(TP_ERR_NOMEM, "out of memory for %zu + %zu bytes of host staging", sbytes, rbytes);
  /* Device -> host: the input (the container's whole range when the send buffer is nested). */
  if (st == TP_SUCCESS && s.staged) {
    if (r.staged && r.owned && s.host != NULL && s.host >= r.host && s.host < r.host + (rbytes ? rbytes : 1))
      st = tp_device_copy(TP_DEVICE_CPU, r.host, d, r.dev, rbytes, stream);
    else
      st = tp_device_copy(TP_DEVICE_CPU, s.host, d, s.dev, sbytes, stream);
  }
  if (st == TP_SUCCESS) st = tp_device_sync(d, id, stream);
  if (st != TP_SUCCESS) {
    st = fail(c, op, st);
  } else {
    tp_coll_args_t h = *a;
    if (s.staged) h.send = s.host;
    if (r.staged) h.recv = r.host;
    h.stream = NULL;
    st = run(c, &h); /* the guarded host call: its errors are already the comm's */
    if (st == TP_SUCCESS && r.staged) {
      st = tp_device_copy(d, r.host == NULL ? NULL : (void *)r.dev, TP_DEVICE_CPU, r.host, rbytes, stream);
      if (st == TP_SUCCESS) st = tp_device_sync(d, id, stream);
      if (st != TP_SUCCESS) {
        char msg[900];
        snprintf(msg, sizeof msg, "%s", tp_last_error());
        st = tp_set_error(st, "%s on rank %d of %d (staged through host memory): copying the result back: %s",
                          op, c->rank, c->size, msg);
      }
    }
  }
  if (s.owned) free(s.host);
  if (r.owned) free(r.host);
  return st;
}

tp_status_t tp_comm_stage_in(tp_comm_t c, const char *op, const void *dev, size_t bytes, int copy_in,
                             tp_stream_t stream, void **host) {
  tp_device_t d;
  int id;
  tp_pointer_device(dev, &d, &id);
  *host = malloc(bytes ? bytes : 1);
  if (!*host) return tp_set_error(TP_ERR_NOMEM, "%s: out of memory for %zu bytes of host staging", op, bytes);
  tp_status_t st = TP_SUCCESS;
  if (copy_in) {
    st = tp_device_copy(TP_DEVICE_CPU, *host, d, dev, bytes, stream);
    if (st == TP_SUCCESS) st = tp_device_sync(d, id, stream);
  }
  if (st != TP_SUCCESS) {
    free(*host);
    *host = NULL;
    return fail(c, op, st);
  }
  return TP_SUCCESS;
}

tp_status_t tp_comm_stage_out(tp_comm_t c, const char *op, void *dev, void *host, size_t bytes, int copy_out,
                              tp_stream_t stream) {
  tp_status_t st = TP_SUCCESS;
  if (copy_out) {
    tp_device_t d;
    int id;
    tp_pointer_device(dev, &d, &id);
    st = tp_device_copy(d, dev, TP_DEVICE_CPU, host, bytes, stream);
    if (st == TP_SUCCESS) st = tp_device_sync(d, id, stream);
    if (st != TP_SUCCESS) {
      char msg[900];
      snprintf(msg, sizeof msg, "%s", tp_last_error());
      st = tp_set_error(st, "%s on rank %d of %d (staged through host memory): copying the result back: %s", op,
                        c->rank, c->size, msg);
    }
  }
  free(host);
  return st;
}
