/*
 * shm backend: point to point.  Each ordered pair of ranks (src -> dst) has a
 * channel with P2P_NBUF chunk buffers and two counters: `sent` (chunks the
 * sender has filled) and `acked` (chunks the receiver has emptied).  A message
 * goes in chunks of p2p_chunk bytes, each with a header (message number, dtype,
 * count, chunk index) that the receiver checks, so a mismatched send and recv
 * fail both sides with TP_ERR_MISMATCH.  A send of up to P2P_NBUF chunks returns
 * at once; sendrecv interleaves its two halves with bounded waits, so a ring of
 * sendrecvs cannot deadlock.
 */
#include <stdio.h>
#include <string.h>

#include "shm_impl.h"

typedef struct {
  const char *buf;
  size_t nbytes, count;
  tp_dtype_t dtype;
  int peer;
  uint32_t msg, nchunks, done;
} p2p_op;

static void p2p_init(shm_ctx *c, p2p_op *o, const void *buf, size_t count, tp_dtype_t dt, int peer, uint32_t msg) {
  o->buf = buf;
  o->count = count;
  o->dtype = dt;
  o->nbytes = count * tp_dtype_size(dt);
  o->peer = peer;
  o->msg = msg;
  o->nchunks = (uint32_t)(o->nbytes ? (o->nbytes + c->p2p_chunk - 1) / c->p2p_chunk : 1);
  o->done = 0;
}

/* One step of a send; max_wait as in wait_word. */
static tp_status_t send_step(shm_ctx *c, p2p_op *o, double max_wait, const char *what) {
  int r = c->comm->rank;
  chan_t *ch = chan(c, r, o->peer);
  uint32_t k = c->p2p_sent[o->peer];
  if (k >= P2P_NBUF)
    TP_CHECK(shm_wait_word(c, &ch->acked, &ch->acked_waiters, k - P2P_NBUF + 1, o->peer, what, max_wait));
  unsigned slot = k % P2P_NBUF;
  size_t off = (size_t)o->done * c->p2p_chunk;
  size_t m = o->nbytes - off < c->p2p_chunk ? o->nbytes - off : c->p2p_chunk;
  p2p_hdr_t *h = &ch->hdr[slot];
  h->msg = o->msg;
  h->dtype = o->dtype;
  h->count = o->count;
  h->chunk = o->done;
  h->nchunks = o->nchunks;
  h->nbytes = m;
  if (m) memcpy(chan_buf(c, r, o->peer, slot), o->buf + off, m);
  c->p2p_sent[o->peer] = k + 1;
  shm_post(&ch->sent, &ch->sent_waiters, k + 1);
  o->done++;
  return TP_SUCCESS;
}

static tp_status_t recv_step(shm_ctx *c, p2p_op *o, double max_wait, const char *what) {
  int r = c->comm->rank;
  chan_t *ch = chan(c, o->peer, r);
  uint32_t k = c->p2p_recvd[o->peer];
  TP_CHECK(shm_wait_word(c, &ch->sent, &ch->sent_waiters, k + 1, o->peer, what, max_wait));
  unsigned slot = k % P2P_NBUF;
  const p2p_hdr_t *h = &ch->hdr[slot];
  if (h->msg != o->msg || h->dtype != (int32_t)o->dtype || h->count != o->count || h->chunk != o->done) {
    char msg[512];
    snprintf(msg, sizeof msg,
             "point-to-point mismatch: rank %d sent %llu %s (message #%u) but rank %d expected "
             "%llu %s (message #%u)",
             o->peer, (unsigned long long)h->count, tp_dtype_name((tp_dtype_t)h->dtype), h->msg, r,
             (unsigned long long)o->count, tp_dtype_name(o->dtype), o->msg);
    tp_shm_publish_abort_status(c, r, msg, TP_ERR_MISMATCH);
    return tp_set_error(TP_ERR_MISMATCH, "%s", msg);
  }
  size_t off = (size_t)o->done * c->p2p_chunk;
  if (h->nbytes) memcpy((char *)o->buf + off, chan_buf(c, o->peer, r, slot), h->nbytes);
  c->p2p_recvd[o->peer] = k + 1;
  shm_post(&ch->acked, &ch->acked_waiters, k + 1);
  o->done++;
  return TP_SUCCESS;
}

/* A point-to-point wait that timed out leaves the peers out of step: fail them too. */
static tp_status_t p2p_done(shm_ctx *c, tp_status_t st) {
  if (st == TP_ERR_TIMEOUT) {
    char msg[768];
    snprintf(msg, sizeof msg, "rank %d failed: %s", c->comm->rank, tp_last_error());
    tp_shm_publish_abort_status(c, c->comm->rank, msg, st);
  }
  shm_set_activity(c, TP_COLL_NONE, c->seq, -1);
  return st;
}

tp_status_t tp_shm_send(struct tp_comm *comm, const void *buf, size_t count, tp_dtype_t dt, int peer,
                        tp_stream_t stream) {
  shm_ctx *c = comm->impl;
  p2p_op o;
  RETURN_IF_ABORTED(c);
  char what[64];
  p2p_init(c, &o, buf, count, dt, peer, ++c->p2p_msg_s[peer]);
  snprintf(what, sizeof what, "send to rank %d", peer);
  shm_set_activity(c, TP_COLL_SEND, o.msg, peer);
  tp_status_t st = TP_SUCCESS;
  while (st == TP_SUCCESS && o.done < o.nchunks) st = send_step(c, &o, 0, what);
  return p2p_done(c, st);
}

tp_status_t tp_shm_recv(struct tp_comm *comm, void *buf, size_t count, tp_dtype_t dt, int peer, tp_stream_t stream) {
  shm_ctx *c = comm->impl;
  p2p_op o;
  RETURN_IF_ABORTED(c);
  char what[64];
  p2p_init(c, &o, buf, count, dt, peer, ++c->p2p_msg_r[peer]);
  snprintf(what, sizeof what, "recv from rank %d", peer);
  shm_set_activity(c, TP_COLL_RECV, o.msg, peer);
  tp_status_t st = TP_SUCCESS;
  while (st == TP_SUCCESS && o.done < o.nchunks) st = recv_step(c, &o, 0, what);
  return p2p_done(c, st);
}

tp_status_t tp_shm_sendrecv(struct tp_comm *comm, const void *sbuf, size_t scount, int dst, void *rbuf, size_t rcount,
                            int src, tp_dtype_t dt, tp_stream_t stream) {
  shm_ctx *c = comm->impl;
  RETURN_IF_ABORTED(c);
  p2p_op so, ro;
  char what[96];
  p2p_init(c, &so, sbuf, scount, dt, dst, ++c->p2p_msg_s[dst]);
  p2p_init(c, &ro, rbuf, rcount, dt, src, ++c->p2p_msg_r[src]);
  snprintf(what, sizeof what, "sendrecv (to rank %d, from rank %d)", dst, src);
  shm_set_activity(c, TP_COLL_SENDRECV, so.msg, dst);
  double t0 = tp_now();
  tp_status_t st = TP_SUCCESS;
  while (so.done < so.nchunks || ro.done < ro.nchunks) {
    int progressed = 0;
    if (so.done < so.nchunks) {
      st = send_step(c, &so, 0.002, what);
      if (st == TP_SUCCESS) progressed = 1;
      else if (st != TP_IN_PROGRESS) break;
    }
    if (ro.done < ro.nchunks) {
      st = recv_step(c, &ro, 0.002, what);
      if (st == TP_SUCCESS) progressed = 1;
      else if (st != TP_IN_PROGRESS) break;
    }
    st = TP_SUCCESS;
    if (progressed) t0 = tp_now();
    else if (tp_now() - t0 > comm->timeout_s) {
      char act[512];
      tp_shm_describe_activity(c, ro.done < ro.nchunks ? src : dst, act, sizeof act);
      st = tp_set_error(TP_ERR_TIMEOUT, "%s on rank %d: timed out after %.1f s: %s", what, comm->rank, comm->timeout_s,
                        act);
      break;
    }
  }
  return p2p_done(c, st);
}
