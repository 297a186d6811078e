/* The host-staged path of the dispatcher (staged.c). */
#ifndef TPCORE_STAGED_IMPL_H
#define TPCORE_STAGED_IMPL_H

#include "comm_impl.h"

/* 1 when p is memory the backend does not take (a host backend given device
 * memory) but whose device table can copy it to and from the host. */
int tp_comm_stage_needed(tp_comm_t c, const void *p);
/* Runs collective `a` through host copies of its device buffers (sbytes of send,
 * rbytes of recv; used_*: this rank's part reads send / writes recv); `run` is the
 * dispatcher's guarded call, given the host buffers and a NULL stream. */
tp_status_t tp_comm_staged(tp_comm_t c, tp_coll_args_t *a, size_t sbytes, size_t rbytes, int used_send,
                           int used_recv, tp_stream_t stream, tp_status_t (*run)(tp_comm_t, tp_coll_args_t *));
/* Point to point: a host copy of a device buffer (*host = malloc'd, copied in when
 * copy_in), and the copy back (when copy_out) and free. */
tp_status_t tp_comm_stage_in(tp_comm_t c, const char *op, const void *dev, size_t bytes, int copy_in,
                             tp_stream_t stream, void **host);
tp_status_t tp_comm_stage_out(tp_comm_t c, const char *op, void *dev, void *host, size_t bytes, int copy_out,
                              tp_stream_t stream);

#endif
