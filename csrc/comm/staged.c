/*
 * The staged path: a buffer on a device the backend does not take, copied through
 * a bounce buffer on one it does.  Both ways, generic over device types (it uses
 * the device table only):
 *
 * - device memory given to a host backend (shm): device -> host copies on the
 *   caller's stream, a sync, the host call, host -> device copies, a sync.  So
 *   several ranks on GPUs (several on one GPU, where NCCL cannot run them) work
 *   over shm.
 * - host memory given to a device backend (nccl: comm->stage_device): host ->
 *   device copies, the call on the caller's stream, a wait (tp_comm_sync, under
 *   the timeout), device -> host copies.  So host arrays keep working when
 *   backend "auto" chose nccl.
 *
 * Host bounce buffers are the device table's CPU memory (not pinned, for now).
 * In-place calls stay in place: a buffer inside another (the in-place
 * all_gather / reduce_scatter forms, or send == recv) is staged inside the
 * other's bounce buffer.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm_impl.h"
#include "staged_impl.h"
#include "tpcore/device.h"

/* The device the bounce buffers live on: the host for a host backend, else the comm's. */
static void bounce_of(tp_comm_t c, tp_device_t *d, int *id) {
  *d = c->ops->streams ? c->stage_device : TP_DEVICE_CPU;
  *id = c->ops->streams ? c->stage_device_id : 0;
}

int tp_comm_buffer_class(tp_comm_t c, const void *p) {
  if (!p) return 0;
  tp_device_t d;
  int id;
  tp_pointer_device(p, &d, &id);
  if ((unsigned)d < 32 && (c->ops->devices & (1u << d))) return 0;
  tp_device_t bd;
  bounce_of(c, &bd, &id);
  if (!c->ops->streams) return tp_device_ops_of(d) ? 1 : 2;
  return d == TP_DEVICE_CPU && bd != TP_DEVICE_CPU && (c->ops->devices & (1u << bd)) && tp_device_ops_of(bd) ? 1 : 2;
}

/* Copies between a caller's buffer and a bounce buffer, then waits for the copy. */
static tp_status_t copy_sync(void *dst, const void *src, int to_bounce, tp_comm_t c, size_t n, tp_stream_t stream,
                             const void *callers) {
  if (!n) return TP_SUCCESS;
  tp_device_t cd, bd;
  int cid, bid;
  tp_pointer_device(callers, &cd, &cid);
  bounce_of(c, &bd, &bid);
  tp_status_t st =
      to_bounce ? tp_device_copy(bd, dst, cd, src, n, stream) : tp_device_copy(cd, dst, bd, src, n, stream);
  if (st != TP_SUCCESS) return st;
  return cd != TP_DEVICE_CPU ? tp_device_sync(cd, cid, stream) : tp_device_sync(bd, bid, stream);
}

static void *bounce_alloc(tp_comm_t c, size_t n) {
  tp_device_t bd;
  int bid;
  bounce_of(c, &bd, &bid);
  void *p = NULL;
  return tp_device_alloc(bd, bid, n ? n : 1, &p) == TP_SUCCESS ? p : NULL;
}

static void bounce_free(tp_comm_t c, void *p) {
  tp_device_t bd;
  int bid;
  bounce_of(c, &bd, &bid);
  if (p) tp_device_free(bd, bid, p);
}

/* A device backend has queued the call on the stream: wait for it before the copies back. */
static tp_status_t wait_call(tp_comm_t c, tp_stream_t stream) {
  return c->ops->streams ? tp_comm_sync(c, stream) : TP_SUCCESS;
}

/* After a failed call: wait (quietly) so that nothing still uses the bounce buffers, keeping the error. */
static tp_status_t after_failure(tp_comm_t c, tp_stream_t stream, tp_status_t st) {
  if (!c->ops->streams) return st;
  char msg[1024];
  snprintf(msg, sizeof msg, "%s", tp_last_error());
  (void)tp_comm_sync(c, stream);
  return tp_set_error(st, "%s", msg);
}

static tp_status_t fail(tp_comm_t c, const char *op, tp_status_t st) {
  char msg[900];
  snprintf(msg, sizeof msg, "%s", tp_last_error());
  /* The peers are (or will be) in the call: fail them now rather than at their timeout. */
  tp_comm_abort(c, msg);
  return tp_set_error(st, "%s on rank %d of %d (staged): %s", op, c->rank, c->size, msg);
}

static tp_status_t back_error(tp_comm_t c, const char *op, tp_status_t st) {
  char msg[900];
  snprintf(msg, sizeof msg, "%s", tp_last_error());
  return tp_set_error(st, "%s on rank %d of %d (staged): copying the result back: %s", op, c->rank, c->size, msg);
}

typedef struct {
  const void *mine; /* the caller's pointer */
  size_t bytes;
  char *bounce; /* its bounce copy (inside the other's when nested) */
  int staged, owned;
} stage_t;

/* inner lies within outer: [inner, inner + ib) inside [outer, outer + ob). */
static int inside(const void *inner, size_t ib, const void *outer, size_t ob) {
  const char *i = inner, *o = outer;
  return i && o && i >= o && ib <= ob && (size_t)(i - o) <= ob - ib;
}

tp_status_t tp_comm_staged(tp_comm_t c, tp_coll_args_t *a, size_t sbytes, size_t rbytes, int used_send, int used_recv,
                           tp_stream_t stream, tp_status_t (*run)(tp_comm_t, tp_coll_args_t *)) {
  const char *op = tp_coll_name(a->kind);
  stage_t s = {a->send, sbytes, NULL, used_send && tp_comm_buffer_class(c, a->send) == 1, 0};
  stage_t r = {a->recv, rbytes, NULL, used_recv && tp_comm_buffer_class(c, a->recv) == 1, 0};
  int s_in_r = 0;
  if (r.staged && s.staged && inside(s.mine, sbytes, r.mine, rbytes)) {
    r.bounce = bounce_alloc(c, rbytes), r.owned = 1, s_in_r = 1;
    if (r.bounce) s.bounce = r.bounce + ((const char *)s.mine - (const char *)r.mine);
  } else if (r.staged && s.staged && inside(r.mine, rbytes, s.mine, sbytes)) {
    s.bounce = bounce_alloc(c, sbytes), s.owned = 1;
    if (s.bounce) r.bounce = s.bounce + ((const char *)r.mine - (const char *)s.mine);
  } else {
    if (s.staged) s.bounce = bounce_alloc(c, sbytes), s.owned = 1;
    if (r.staged) r.bounce = bounce_alloc(c, rbytes), r.owned = 1;
  }
  tp_status_t st = TP_SUCCESS;
  if ((s.staged && !s.bounce) || (r.staged && !r.bounce))
    st = tp_set_error(TP_ERR_NOMEM, "out of memory for %zu + %zu bytes of staging buffers", sbytes, rbytes);
  /* The input: the container's whole range when the send buffer is nested in recv. */
  if (st == TP_SUCCESS && s.staged)
    st = s_in_r ? copy_sync(r.bounce, r.mine, 1, c, rbytes, stream, r.mine)
                : copy_sync(s.bounce, s.mine, 1, c, sbytes, stream, s.mine);
  if (st != TP_SUCCESS) {
    st = fail(c, op, st);
  } else {
    tp_coll_args_t h = *a;
    if (s.staged) h.send = s.bounce;
    if (r.staged) h.recv = r.bounce;
    h.stream = c->ops->streams ? stream : NULL;
    st = run(c, &h); /* the guarded call: its errors are already the comm's */
    if (st == TP_SUCCESS) st = wait_call(c, stream);
    if (st == TP_SUCCESS && r.staged) {
      st = copy_sync((void *)r.mine, r.bounce, 0, c, rbytes, stream, r.mine);
      if (st != TP_SUCCESS) st = back_error(c, op, st);
    }
  }
  if (st != TP_SUCCESS) st = after_failure(c, stream, st);
  if (s.owned) bounce_free(c, s.bounce);
  if (r.owned) bounce_free(c, r.bounce);
  return st;
}

tp_status_t tp_comm_stage_in(tp_comm_t c, const char *op, const void *mine, size_t bytes, int copy_in,
                             tp_stream_t stream, void **bounce) {
  *bounce = bounce_alloc(c, bytes);
  if (!*bounce) return tp_set_error(TP_ERR_NOMEM, "%s: out of memory for %zu bytes of staging buffer", op, bytes);
  tp_status_t st = copy_in ? copy_sync(*bounce, mine, 1, c, bytes, stream, mine) : TP_SUCCESS;
  if (st != TP_SUCCESS) {
    bounce_free(c, *bounce);
    *bounce = NULL;
    return fail(c, op, st);
  }
  return TP_SUCCESS;
}

tp_status_t tp_comm_stage_out(tp_comm_t c, const char *op, void *mine, void *bounce, size_t bytes, int copy_out,
                              tp_status_t prior, tp_stream_t stream) {
  if (prior != TP_SUCCESS) {
    prior = after_failure(c, stream, prior);
    bounce_free(c, bounce);
    return prior;
  }
  tp_status_t st = wait_call(c, stream);
  if (st == TP_SUCCESS && copy_out) {
    st = copy_sync(mine, bounce, 0, c, bytes, stream, mine);
    if (st != TP_SUCCESS) st = back_error(c, op, st);
  }
  bounce_free(c, bounce);
  return st;
}
