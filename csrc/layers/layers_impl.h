/* Private helpers shared by the layers: host handles, collective buffers with the
 * plain-memory fallback, the collective wrappers (the one place that calls comm.h),
 * the tensor checks and the workspace arena. */
#ifndef TPCORE_LAYERS_IMPL_H
#define TPCORE_LAYERS_IMPL_H

#include <stddef.h>

#include "../comm/comm_impl.h"
#include "../devices/device_impl.h"
#include "arena.h"
#include "tpcore/device.h"
#include "tpcore/layers.h"
#include "tpcore/partition.h"

/* ------------------------------------------------------------ host handles */

/* A layer's handle (and its small host arrays) in one zeroed host allocation from the
 * CPU device table. */
static inline tp_status_t tp_host_zalloc(size_t nbytes, void **p, const char *what) {
  tp_status_t st = tp_device_alloc(TP_DEVICE_CPU, 0, nbytes, p);
  if (st != TP_SUCCESS) return tp_set_error(TP_ERR_NOMEM, "%s: out of memory", what);
  memset(*p, 0, nbytes); /* host metadata, not layer data */
  return TP_SUCCESS;
}
static inline void tp_host_free(void *p) { tp_device_free(TP_DEVICE_CPU, 0, p); }

/* The device a config names: it must be usable in this process. */
static inline tp_status_t tp_layer_device(const char *op, tp_device_t device, int device_id) {
  if ((unsigned)device >= TP_NUM_DEVICE_TYPES)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: device %d is not a tp_device_t", op, (int)device);
  if (!tp_device_available(device))
    return tp_set_error(TP_ERR_UNSUPPORTED,
                        "%s: device %s is not available (this build of tpcore or this "
                        "machine has none)",
                        op, tp_device_name(device));
  const tp_device_ops *ops = tp_device_ops_of(device);
  if (device_id < 0 || device_id >= ops->count())
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "%s: device_id %d is out of range (this process has %d %s "
                        "device%s)",
                        op, device_id, ops->count(), tp_device_name(device), ops->count() == 1 ? "" : "s");
  return TP_SUCCESS;
}

/* ------------------------------------------------------- collective buffers */

/* A buffer for a layer's collectives, grown on demand: in the communicator's registered
 * memory (collectives on it take the zero-copy path) when the backend has it and the
 * layer lives on the host, else plain device memory (a backend without mem_alloc, or
 * TPCORE_REGISTERED_MEMORY=0: TP_ERR_UNSUPPORTED is cleared and the layer goes on). */
typedef struct {
  void *ptr;
  tp_mem_t mem; /* NULL: plain device memory */
  size_t cap;
  int plain; /* the backend declined registered memory: do not ask again */
  tp_device_t device;
  int device_id;
} reg_buf;

static inline void tp_reg_release(reg_buf *rb) {
  if (rb->mem) tp_mem_release(rb->mem);
  else if (rb->ptr) tp_device_free(rb->device, rb->device_id, rb->ptr);
  rb->mem = NULL;
  rb->ptr = NULL;
  rb->cap = 0;
}

/* Collective: every rank asks for the same size (M and the shapes agree). */
static inline tp_status_t tp_reg_ensure(tp_comm_t comm, reg_buf *rb, size_t nbytes, tp_device_t device, int device_id) {
  if (rb->cap >= nbytes && rb->ptr) return TP_SUCCESS;
  tp_reg_release(rb);
  size_t cap = 4096;
  if (nbytes > cap && !tp_add_size(nbytes, nbytes / 2, &cap)) cap = nbytes;
  rb->device = device;
  rb->device_id = device_id;
  if (!rb->plain && device == TP_DEVICE_CPU) {
    tp_status_t st = tp_comm_mem_alloc(comm, cap, &rb->ptr, &rb->mem);
    if (st == TP_SUCCESS) {
      rb->cap = cap;
      return TP_SUCCESS;
    }
    if (st != TP_ERR_UNSUPPORTED) return st;
    tp_clear_error(); /* no registered memory on this backend: plain memory, staged collectives */
    rb->plain = 1;
    rb->ptr = NULL;
    rb->mem = NULL;
  }
  TP_CHECK(tp_device_alloc(device, device_id, cap, &rb->ptr));
  rb->cap = cap;
  return TP_SUCCESS;
}

/* ------------------------------------------------------- collective calls */
/* Every collective of the layers goes through these (float32, in place where the
 * layer's algorithm is).  region: the tag of the call in the communicator's statistics
 * and history ("attention", "mlp", "embedding", "head"; the previous tag is restored
 * after); NULL: the communicator's current tag (a layer used alone: "other"). */

static inline tp_status_t tp_layer_all_reduce(void *buf, size_t count, tp_redop_t op, tp_comm_t comm,
                                              const char *region, tp_stream_t stream) {
  if (!region) return tp_all_reduce(buf, buf, count, TP_FLOAT32, op, comm, stream);
  const char *prev = tp_comm_set_region(comm, region);
  tp_status_t st = tp_all_reduce(buf, buf, count, TP_FLOAT32, op, comm, stream);
  tp_comm_set_region(comm, prev);
  return st;
}

static inline tp_status_t tp_layer_all_gather_v(const void *send, void *recv, const size_t *counts, tp_comm_t comm,
                                                const char *region, tp_stream_t stream) {
  if (!region) return tp_all_gather_v(send, recv, counts, TP_FLOAT32, comm, stream);
  const char *prev = tp_comm_set_region(comm, region);
  tp_status_t st = tp_all_gather_v(send, recv, counts, TP_FLOAT32, comm, stream);
  tp_comm_set_region(comm, prev);
  return st;
}

/* ------------------------------------------------------------ tensor checks */

/* An argument that must not be NULL: "<op>: <name> is NULL (NULL argument)". */
#define TP_NONNULL(op, p, name)                                                                         \
  do {                                                                                                  \
    if (!(p)) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s is NULL (NULL argument)", op, name); \
  } while (0)

/* ---------------------------------------------------------- memory accounting */

/* The bytes a tensor of nbytes takes in an arena (rounded up to the allocation's alignment,
 * at least one unit, as tp_arena_add plans it); 0 when the tensor is absent (p NULL). */
static inline size_t tp_mem_tensor(const void *p, size_t nbytes) {
  size_t r = 0;
  if (!p || !tp_arena_add(&r, nbytes)) return 0;
  return r;
}

/* The start of a tp_*_memory call: mem checked (non-NULL, the caller's size field this
 * version's), zeroed and set to the layer's device. */
static inline tp_status_t tp_memory_begin(const char *op, tp_layer_memory_t *mem, tp_device_t device, int device_id) {
  TP_NONNULL(op, mem, "mem");
  if (mem->size != sizeof(tp_layer_memory_t))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "%s: mem->size is %zu, not sizeof(tp_layer_memory_t) = %zu (a "
                        "struct built for another tpcore version)",
                        op, mem->size, sizeof(tp_layer_memory_t));
  memset(mem, 0, sizeof *mem);
  mem->size = sizeof *mem;
  mem->device = device;
  mem->device_id = device_id;
  return TP_SUCCESS;
}

/* dst += src, field by field (a layer's sub-layers on the same device). */
static inline void tp_memory_add(tp_layer_memory_t *dst, const tp_layer_memory_t *src) {
  dst->params += src->params;
  dst->grads += src->grads;
  dst->workspace += src->workspace;
  dst->cache += src->cache;
  dst->cache_used += src->cache_used;
  dst->comm += src->comm;
}

/* t must be a float32 (or `dtype`) C-contiguous 2-D tensor [rows, cols] on the layer's
 * device; rows < 0: any (then *rows_out gets shape[0]).  Errors name op and arg. */
static inline tp_status_t tp_check_matrix(const char *op, const char *arg, const tp_tensor *t, tp_dtype_t dtype,
                                          int64_t rows, int64_t cols, tp_device_t device, int device_id,
                                          int64_t *rows_out) {
  if (!t) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s is NULL (NULL argument)", op, arg);
  if (t->dtype != dtype)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s must be %s, got %s", op, arg, tp_dtype_name(dtype),
                        tp_dtype_name(t->dtype));
  if (t->ndim != 2 || t->shape[0] < 0 || t->shape[1] != cols || (rows >= 0 && t->shape[0] != rows)) {
    if (rows >= 0)
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s must have shape [%lld, %lld], got %d-D [%lld, %lld]", op,
                          arg, (long long)rows, (long long)cols, t->ndim, (long long)(t->ndim > 0 ? t->shape[0] : 0),
                          (long long)(t->ndim > 1 ? t->shape[1] : 0));
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s must have shape [rows, %lld], got %d-D [%lld, %lld]", op, arg,
                        (long long)cols, t->ndim, (long long)(t->ndim > 0 ? t->shape[0] : 0),
                        (long long)(t->ndim > 1 ? t->shape[1] : 0));
  }
  if (t->shape[0] > 0 && cols > 0) {
    if ((cols > 1 && t->strides[1] != 1) || (t->shape[0] > 1 && t->strides[0] != cols))
      return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                          "%s: %s must be C-contiguous (row stride %lld, column stride %lld "
                          "elements)",
                          op, arg, (long long)t->strides[0], (long long)t->strides[1]);
    if (!t->data) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s has no data (NULL argument)", op, arg);
  }
  TP_CHECK(tp_check_device(op, arg, t, device, device_id));
  if (rows_out) *rows_out = t->shape[0];
  return TP_SUCCESS;
}

/* A 1-D tensor [n] of `dtype` (n < 0: any; *n_out gets it). */
static inline tp_status_t tp_check_vector(const char *op, const char *arg, const tp_tensor *t, tp_dtype_t dtype,
                                          int64_t n, tp_device_t device, int device_id, int64_t *n_out) {
  if (!t) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s is NULL (NULL argument)", op, arg);
  if (t->dtype != dtype)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s must be %s, got %s", op, arg, tp_dtype_name(dtype),
                        tp_dtype_name(t->dtype));
  if (t->ndim != 1 || t->shape[0] < 0 || (n >= 0 && t->shape[0] != n))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s must be 1-D with %lld entries, got %d-D [%lld]", op, arg,
                        (long long)n, t->ndim, (long long)(t->ndim > 0 ? t->shape[0] : 0));
  if (t->shape[0] > 1 && t->strides[0] != 1)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s must be contiguous (stride %lld elements)", op, arg,
                        (long long)t->strides[0]);
  if (t->shape[0] > 0 && !t->data)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s has no data (NULL argument)", op, arg);
  TP_CHECK(tp_check_device(op, arg, t, device, device_id));
  if (n_out) *n_out = t->shape[0];
  return TP_SUCCESS;
}

/* ------------------------------------------------------- fused-block calls */

/* Calls of the linear layers for the fused blocks:
 * TP_LIN_BORROW_INPUT  forward keeps a pointer to x (when contiguous) instead of a
 *                      copy for the backward: x must stay alive and unchanged until
 *                      then (the MLP's activation workspace, the attention output);
 * TP_LIN_SKIP_BIAS     the caller adds the bias (forward) and accumulates its
 *                      gradient (backward) itself, fused with the activation;
 * TP_LIN_NO_BACKWARD   (with BORROW_INPUT) nothing is kept: a backward after it is refused.
 * Pointers are on the layer's device, M rows checked by the caller. */
enum { TP_LIN_BORROW_INPUT = 1, TP_LIN_SKIP_BIAS = 2, TP_LIN_NO_BACKWARD = 4 };
tp_status_t tp_parallel_linear_forward_ex(tp_parallel_linear_t L, float *y, const float *x, int64_t M, int flags,
                                          tp_stream_t stream);
/* The region tag of L's collectives (a static string; NULL: the communicator's current tag):
 * the owner's ("attention" for a block's output projection, "mlp" for an MLP's). */
void tp_parallel_linear_set_region(tp_parallel_linear_t L, const char *region);
/* Forwards write their collective output into rb (NULL: the layer's own buffer) until reset:
 * a block's inference forward lends its output projection and fc2 the workspace's one buffer,
 * whose contents die before the next layer writes it.  rb is grown on L's communicator. */
void tp_parallel_linear_borrow_out(tp_parallel_linear_t L, reg_buf *rb);
tp_status_t tp_parallel_linear_backward_ex(tp_parallel_linear_t L, float *dx, const float *dy, int64_t M, int flags,
                                           tp_stream_t stream);
/* The MLP on raw pointers of its device (M checked here), for the block. */
tp_status_t tp_parallel_mlp_forward_raw(tp_parallel_mlp_t m, float *y, const float *x, int64_t M, tp_stream_t stream);
/* A forward that keeps nothing for backward: h [M, f1] and a [M, f] are the caller's (a
 * block's inference workspace), fc1 and fc2 borrow their inputs; backward is refused after it. */
tp_status_t tp_parallel_mlp_forward_nograd(tp_parallel_mlp_t m, float *y, const float *x, int64_t M, float *h, float *a,
                                           tp_stream_t stream);
/* The MLP's activation widths: *f1 (fc1's local outputs: 2 x f gated) and *f (fc2's local inputs). */
void tp_parallel_mlp_widths(tp_parallel_mlp_t m, int64_t *f1, int64_t *f);
tp_status_t tp_parallel_mlp_backward_raw(tp_parallel_mlp_t m, float *dx, const float *dy, int64_t M,
                                         tp_stream_t stream);

/* The parameters of a layer: one device allocation (an arena reserved once) carved into
 * weights and biases, zeroed, then drawn by the kernel table's seeded init entries on the
 * device.  Their gradients are another arena, allocated (zeroed) on demand: by the first
 * backward or tp_*_alloc_grads, so that a layer made for inference never holds them. */

#endif
