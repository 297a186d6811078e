/* The host-staged path of the dispatcher (staged.c). */
#ifndef TPCORE_STAGED_IMPL_H
#define TPCORE_STAGED_IMPL_H

#include "comm_impl.h"

/* Where buffer p stands with the backend: 0 taken as it is; 1 staged through a
 * bounce buffer (device memory given to a host backend, or host memory given to a
 * device backend with comm->stage_device set); 2 refused. */
int tp_comm_buffer_class(tp_comm_t c, const void *p);
/* Runs collective `a` through host copies of its device buffers (sbytes of send,
 * rbytes of recv; used_*: this rank's part reads send / writes recv); `run` is the
 * dispatcher's guarded call, given the host buffers and a NULL stream. */
tp_status_t tp_comm_staged(tp_comm_t c, tp_coll_args_t *a, size_t sbytes, size_t rbytes, int used_send, int used_recv,
                           tp_stream_t stream, tp_status_t (*run)(tp_comm_t, tp_coll_args_t *));
/* Point to point: a bounce copy of the caller's buffer (copied in when copy_in);
 * after the call (its status: prior), a wait for a device backend, the copy back
 * (when copy_out and the call succeeded) and the free. */
tp_status_t tp_comm_stage_in(tp_comm_t c, const char *op, const void *mine, size_t bytes, int copy_in,
                             tp_stream_t stream, void **bounce);
tp_status_t tp_comm_stage_out(tp_comm_t c, const char *op, void *mine, void *bounce, size_t bytes, int copy_out,
                              tp_status_t prior, tp_stream_t stream);

#endif
