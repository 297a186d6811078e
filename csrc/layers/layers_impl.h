/* Private helpers shared by the layers. */
#ifndef TPCORE_LAYERS_IMPL_H
#define TPCORE_LAYERS_IMPL_H

#include <stddef.h>
#include <stdlib.h>

#include "../comm/comm_impl.h"
#include "../kernels/kernels_legacy.h"
#include "tpcore/layers.h"

/* A buffer in the communicator's registered memory, grown on demand: collectives
 * on it take the zero-copy path. */
typedef struct {
  void *ptr;
  tp_mem_t mem;
  size_t cap;
} reg_buf;

/* Collective: every rank asks for the same size (M and the shapes agree). */
static inline tp_status_t tp_reg_ensure(tp_comm_t comm, reg_buf *rb, size_t nbytes) {
  if (rb->cap >= nbytes && rb->ptr) return TP_SUCCESS;
  if (rb->mem) tp_mem_release(rb->mem);
  rb->mem = NULL;
  rb->ptr = NULL;
  rb->cap = 0;
  size_t cap = 4096;
  if (nbytes > cap && !tp_add_size(nbytes, nbytes / 2, &cap)) cap = nbytes;
  TP_CHECK(tp_comm_mem_alloc(comm, cap, &rb->ptr, &rb->mem));
  rb->cap = cap;
  return TP_SUCCESS;
}

static inline void tp_reg_release(reg_buf *rb) {
  if (rb->mem) tp_mem_release(rb->mem);
  rb->mem = NULL;
  rb->ptr = NULL;
  rb->cap = 0;
}

/* Grow a malloc'd array to hold n elements of `elem` bytes (contents not kept). */
static inline tp_status_t tp_grow(void **p, int64_t *cap, int64_t n, size_t elem, const char *what) {
  if (n <= *cap && *p) return TP_SUCCESS;
  size_t nbytes;
  if (!tp_mul_size((size_t)(n > 0 ? n : 1), elem, &nbytes))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %lld elements of %zu bytes overflow a size", what,
                        (long long)n, elem);
  void *q = malloc(nbytes);
  if (!q) return tp_set_error(TP_ERR_NOMEM, "%s: out of memory for %lld elements", what, (long long)n);
  free(*p);
  *p = q;
  *cap = n;
  return TP_SUCCESS;
}

/* Calls of the linear layers for the fused blocks:
 * TP_LIN_BORROW_INPUT  forward keeps a pointer to x (when contiguous) instead of a
 *                      copy for the backward: x must stay alive and unchanged until
 *                      then (the MLP's activation workspace);
 * TP_LIN_SKIP_BIAS     the caller adds the bias (forward) and accumulates its
 *                      gradient (backward) itself, fused with the activation. */
enum { TP_LIN_BORROW_INPUT = 1, TP_LIN_SKIP_BIAS = 2 };
tp_status_t tp_parallel_linear_forward_ex(tp_parallel_linear_t L, float *y, const float *x, int64_t M, int flags);
tp_status_t tp_parallel_linear_backward_ex(tp_parallel_linear_t L, float *dx, const float *dy, int64_t M, int flags);

#endif
