/*
 * nccl backend: the operations.  Every collective and point-to-point call is
 * queued on the caller's stream and returns (NCCL's model); tp_comm_sync (and
 * destroy) wait for it under the communicator's timeout.  Each collective first
 * posts its descriptor (nccl.c) so that a mismatched call is named, not hung on.
 *
 * Uneven all_gather_v / reduce_scatter_v: one group of ncclBroadcast (rank p's
 * block from root p) / ncclReduce (block p to root p) per rank; the even forms
 * use ncclAllGather / ncclReduceScatter.  all_to_all: one group of ncclSend / ncclRecv
 * per peer (the counts cannot be compared across ranks here: a mismatch is NCCL's).  barrier: an all_reduce of one int on a
 * scratch buffer, then a wait (a barrier returns when every rank has joined).
 */
#include <stdlib.h>
#include <string.h>

#include "nccl_impl.h"
#include "tpcore/device.h"

int tp_nccl_dtype(tp_dtype_t d) {
  switch (d) {
    case TP_FLOAT32: return ncclFloat32;
    case TP_FLOAT64: return ncclFloat64;
    case TP_FLOAT16: return ncclFloat16;
    case TP_BFLOAT16: return ncclBfloat16;
    case TP_INT8: return ncclInt8;
    case TP_UINT8: return ncclUint8;
    case TP_INT32: return ncclInt32;
    case TP_INT64: return ncclInt64;
    default: return -1;
  }
}

int tp_nccl_op(tp_redop_t op) {
  switch (op) {
    case TP_SUM: return ncclSum;
    case TP_PROD: return ncclProd;
    case TP_MIN: return ncclMin;
    case TP_MAX: return ncclMax;
    case TP_AVG: return ncclAvg;
    default: return -1;
  }
}

#define CALL(x, name, expr) TP_CHECK(tp_nccl_settle((x), (name), (expr)))

static int equal_counts(const tp_coll_args_t *a, int n) {
  for (int p = 1; p < n; p++)
    if (a->counts[p] != a->counts[0]) return 0;
  return 1;
}

/* Runs `n` calls inside one NCCL group; the group's end settles them. */
static tp_status_t grouped_v(nccl_ctx *x, const tp_coll_args_t *a, ncclDataType_t dt, ncclRedOp_t op,
                             tp_nccl_stream_t s) {
  const tp_nccl_api_t *api = x->api;
  int n = x->comm->size, me = x->comm->rank;
  size_t es = tp_dtype_size(a->dtype), off = 0;
  ncclResult_t r = api->GroupStart();
  if (r != ncclSuccess) return tp_nccl_error(x, "ncclGroupStart", r);
  for (int p = 0; p < n && r == ncclSuccess; p++) {
    size_t cnt = a->counts[p];
    if (a->kind == TP_COLL_ALL_GATHER)
      r = api->Broadcast(p == me ? a->send : NULL, (char *)a->recv + off * es, cnt, dt, p, x->nc, s);
    else r = api->Reduce((const char *)a->send + off * es, p == me ? a->recv : NULL, cnt, dt, op, p, x->nc, s);
    off += cnt;
  }
  ncclResult_t e = api->GroupEnd();
  if (r != ncclSuccess && r != ncclInProgress)
    return tp_nccl_error(x, a->kind == TP_COLL_ALL_GATHER ? "ncclBroadcast" : "ncclReduce", r);
  return tp_nccl_settle(x, "ncclGroupEnd", e);
}

/* all_to_all: one group of ncclSend / ncclRecv per peer with a non-zero block (NCCL pairs a
 * rank's send to q with q's receive from it; a zero count on both sides is skipped on both). */
static tp_status_t all_to_all(nccl_ctx *x, const tp_coll_args_t *a, ncclDataType_t dt, tp_nccl_stream_t s) {
  const tp_nccl_api_t *api = x->api;
  int n = x->comm->size;
  size_t es = tp_dtype_size(a->dtype), soff = 0, roff = 0;
  ncclResult_t r = api->GroupStart();
  if (r != ncclSuccess) return tp_nccl_error(x, "ncclGroupStart", r);
  const char *failed = NULL;
  for (int p = 0; p < n && !failed; p++) {
    size_t sc = a->counts[p], rc = a->recv_counts[p];
    if (sc) r = api->Send((const char *)a->send + soff * es, sc, dt, p, x->nc, s);
    if (r != ncclSuccess && r != ncclInProgress) failed = "ncclSend";
    else if (rc) r = api->Recv((char *)a->recv + roff * es, rc, dt, p, x->nc, s);
    if (!failed && r != ncclSuccess && r != ncclInProgress) failed = "ncclRecv";
    soff += sc, roff += rc;
  }
  ncclResult_t e = api->GroupEnd();
  if (failed) return tp_nccl_error(x, failed, r);
  return tp_nccl_settle(x, "ncclGroupEnd", e);
}

static tp_status_t nccl_collective(struct tp_comm *c, const tp_coll_args_t *a) {
  nccl_ctx *x = c->impl;
  const tp_nccl_api_t *api = x->api;
  tp_nccl_stream_t s = (tp_nccl_stream_t)a->stream;
  ncclDataType_t dt = (ncclDataType_t)tp_nccl_dtype(a->dtype);
  ncclRedOp_t op = (ncclRedOp_t)tp_nccl_op(a->op);
  if ((int)dt < 0 || (int)op < 0)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: dtype or op has no NCCL equivalent", tp_coll_name(a->kind));
  if (atomic_load(&x->abort_flag))
    return tp_set_error(TP_ERR_ABORTED, "%s on rank %d of %d: the communicator was aborted: %s", tp_coll_name(a->kind),
                        c->rank, c->size, x->abort_reason);
  TP_CHECK(tp_nccl_post(x, a));
  tp_nccl_note_stream(x, a->stream);
  switch (a->kind) {
    case TP_COLL_ALL_REDUCE:
      CALL(x, "ncclAllReduce", api->AllReduce(a->send, a->recv, a->count, dt, op, x->nc, s));
      return TP_SUCCESS;
    case TP_COLL_BROADCAST:
      CALL(x, "ncclBroadcast", api->Broadcast(a->send, a->recv, a->count, dt, a->root, x->nc, s));
      return TP_SUCCESS;
    case TP_COLL_REDUCE:
      CALL(x, "ncclReduce", api->Reduce(a->send, a->recv, a->count, dt, op, a->root, x->nc, s));
      return TP_SUCCESS;
    case TP_COLL_ALL_GATHER:
      if (!equal_counts(a, c->size)) return grouped_v(x, a, dt, op, s);
      CALL(x, "ncclAllGather", api->AllGather(a->send, a->recv, a->count, dt, x->nc, s));
      return TP_SUCCESS;
    case TP_COLL_REDUCE_SCATTER:
      if (!equal_counts(a, c->size)) return grouped_v(x, a, dt, op, s);
      CALL(x, "ncclReduceScatter", api->ReduceScatter(a->send, a->recv, a->count, dt, op, x->nc, s));
      return TP_SUCCESS;
    case TP_COLL_ALL_TO_ALL: return all_to_all(x, a, dt, s);
    case TP_COLL_BARRIER:
      CALL(x, "ncclAllReduce", api->AllReduce(x->scratch, x->scratch, 1, ncclInt32, ncclSum, x->nc, s));
      return tp_nccl_wait(x, a->stream, "barrier");
    default: return tp_set_error(TP_ERR_INTERNAL, "nccl: collective kind %d", (int)a->kind);
  }
}

static tp_status_t p2p(struct tp_comm *c, const void *sbuf, size_t scount, int dst, void *rbuf, size_t rcount, int src,
                       tp_dtype_t dtype, tp_stream_t stream) {
  nccl_ctx *x = c->impl;
  const tp_nccl_api_t *api = x->api;
  ncclDataType_t dt = (ncclDataType_t)tp_nccl_dtype(dtype);
  tp_nccl_stream_t s = (tp_nccl_stream_t)stream;
  if (atomic_load(&x->abort_flag))
    return tp_set_error(TP_ERR_ABORTED, "p2p on rank %d of %d: the communicator was aborted: %s", c->rank, c->size,
                        x->abort_reason);
  tp_nccl_note_stream(x, stream);
  ncclResult_t r = api->GroupStart();
  if (r != ncclSuccess) return tp_nccl_error(x, "ncclGroupStart", r);
  ncclResult_t rs = ncclSuccess, rr = ncclSuccess;
  if (dst >= 0) rs = api->Send(sbuf, scount, dt, dst, x->nc, s);
  if (src >= 0) rr = api->Recv(rbuf, rcount, dt, src, x->nc, s);
  ncclResult_t e = api->GroupEnd();
  if (rs != ncclSuccess && rs != ncclInProgress) return tp_nccl_error(x, "ncclSend", rs);
  if (rr != ncclSuccess && rr != ncclInProgress) return tp_nccl_error(x, "ncclRecv", rr);
  return tp_nccl_settle(x, "ncclGroupEnd", e);
}

static tp_status_t nccl_send(struct tp_comm *c, const void *buf, size_t count, tp_dtype_t dtype, int peer,
                             tp_stream_t stream) {
  return p2p(c, buf, count, peer, NULL, 0, -1, dtype, stream);
}

static tp_status_t nccl_recv(struct tp_comm *c, void *buf, size_t count, tp_dtype_t dtype, int peer,
                             tp_stream_t stream) {
  return p2p(c, NULL, 0, -1, buf, count, peer, dtype, stream);
}

static tp_status_t nccl_sendrecv(struct tp_comm *c, const void *sendbuf, size_t sendcount, int dst, void *recvbuf,
                                 size_t recvcount, int src, tp_dtype_t dtype, tp_stream_t stream) {
  return p2p(c, sendbuf, sendcount, dst, recvbuf, recvcount, src, dtype, stream);
}

/* ------------------------------------------------------------ registered memory */

typedef struct nccl_mem {
  struct tp_mem base;
  const tp_nccl_api_t *api;
  nccl_ctx *owner; /* NULL once its communicator is gone (deregistered then) */
  void *ptr, *reg;
  struct nccl_mem *next;
} nccl_mem;

static void mem_release(struct tp_mem *m) {
  nccl_mem *h = (nccl_mem *)m;
  nccl_ctx *x = h->owner;
  if (x) {
    for (nccl_mem **pp = &x->mems; *pp; pp = &(*pp)->next)
      if (*pp == h) {
        *pp = h->next;
        break;
      }
    if (x->nc && h->reg) x->api->CommDeregister(x->nc, h->reg);
  }
  if (h->ptr) h->api->MemFree(h->ptr);
  free(h);
}

/* At destroy: deregister what is still registered; the memory stays until tp_mem_release. */
void tp_nccl_forget_mems(nccl_ctx *x) {
  for (nccl_mem *h = x->mems; h; h = h->next) {
    if (x->nc && h->reg) x->api->CommDeregister(x->nc, h->reg);
    h->reg = NULL;
    h->owner = NULL;
  }
  x->mems = NULL;
}

static tp_status_t nccl_mem_alloc(struct tp_comm *c, size_t nbytes, void **ptr, tp_mem_t *handle) {
  nccl_ctx *x = c->impl;
  tp_coll_args_t a = {TP_COLL_ALLOC, NULL, NULL, nbytes, NULL, nbytes, TP_UINT8, TP_SUM, 0, NULL, NULL};
  TP_CHECK(tp_nccl_post(x, &a));
  TP_CHECK(tp_device_set_current(TP_DEVICE_CUDA, x->device_id)); /* ncclMemAlloc uses the current device */
  nccl_mem *h = calloc(1, sizeof *h);
  if (!h) return tp_set_error(TP_ERR_NOMEM, "alloc: out of memory");
  h->base.release = mem_release;
  h->api = x->api;
  ncclResult_t r = x->api->MemAlloc(&h->ptr, nbytes ? nbytes : 1);
  if (r != ncclSuccess) {
    free(h);
    return tp_nccl_error(x, "ncclMemAlloc", r);
  }
  r = x->api->CommRegister(x->nc, h->ptr, nbytes ? nbytes : 1, &h->reg);
  tp_status_t st = tp_nccl_settle(x, "ncclCommRegister", r);
  if (st != TP_SUCCESS) {
    x->api->MemFree(h->ptr);
    free(h);
    return st;
  }
  h->owner = x;
  h->next = x->mems;
  x->mems = h;
  c->stats.zero_copy += 0;
  *ptr = h->ptr;
  *handle = &h->base;
  return TP_SUCCESS;
}

static tp_status_t nccl_sync(struct tp_comm *c, tp_stream_t stream) {
  nccl_ctx *x = c->impl;
  return tp_nccl_wait(x, stream, "sync");
}

tp_status_t tp_nccl_split(struct tp_comm *c, int color, int key, struct tp_comm **out);
void tp_nccl_abort(struct tp_comm *c, const char *reason);
void tp_nccl_destroy(struct tp_comm *c);

const tp_backend_ops tp_nccl_ops = {
    .name = "nccl",
    .devices = 1u << TP_DEVICE_CUDA,
    .streams = 1,
    .collective = nccl_collective,
    .send = nccl_send,
    .recv = nccl_recv,
    .sendrecv = nccl_sendrecv,
    .split = tp_nccl_split,
    .mem_alloc = nccl_mem_alloc,
    .stats = NULL,
    .abort = tp_nccl_abort,
    .destroy = tp_nccl_destroy,
    .sync = nccl_sync,
};
