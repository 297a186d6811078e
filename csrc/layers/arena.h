/*
 * A workspace arena: one device allocation carved into aligned slices (llm.c's
 * "scratch passed in", ggml's graph allocator in miniature).
 *
 * A layer plans a call's workspaces up front: it adds every slice's size with
 * tp_arena_add (each rounded up to TP_DEVICE_ALIGN bytes, and never empty, so that
 * no kernel or copy gets a NULL workspace), then tp_arena_reserve(total) makes the
 * one allocation large enough and rewinds it, and tp_arena_take hands out the
 * slices in the same order.  The allocation grows only when a call needs more than
 * it has (a larger batch): then the old one is freed first (its contents are lost)
 * and a new one of exactly `total` bytes is taken from the device table.  A warm
 * layer (same or smaller shapes) allocates nothing.  Slices handed out by one
 * reserve stay valid until the next reserve that grows: a forward carves what its
 * backward reads, and backward takes no new slices.
 */
#ifndef TPCORE_ARENA_H
#define TPCORE_ARENA_H

#include "../core/core_impl.h"
#include "tpcore/device.h"

typedef struct {
  tp_device_t device;
  int device_id;
  char *base;
  size_t cap, used;
} tp_arena_t;

static inline void tp_arena_init(tp_arena_t *a, tp_device_t device, int device_id) {
  a->device = device;
  a->device_id = device_id;
  a->base = NULL;
  a->cap = a->used = 0;
}

/* *total += nbytes rounded up to the alignment (at least one alignment unit); 0 on overflow. */
static inline int tp_arena_add(size_t *total, size_t nbytes) {
  size_t r;
  if (!tp_add_size(nbytes ? nbytes : 1, TP_DEVICE_ALIGN - 1, &r)) return 0;
  r -= r % TP_DEVICE_ALIGN;
  return tp_add_size(*total, r, total);
}

/* The element count n of `elem` bytes as a slice size added to *total; 0 on overflow. */
static inline int tp_arena_add_n(size_t *total, int64_t n, size_t elem) {
  size_t b;
  return n >= 0 && tp_mul_size((size_t)n, elem, &b) && tp_arena_add(total, b);
}

/* At least `total` bytes (from tp_arena_add), rewound.  Contents are kept unless it grows. */
static inline tp_status_t tp_arena_reserve(tp_arena_t *a, size_t total, const char *what) {
  a->used = 0;
  if (a->base && a->cap >= total) return TP_SUCCESS;
  if (a->base) tp_device_free(a->device, a->device_id, a->base);
  a->base = NULL;
  a->cap = 0;
  void *p;
  tp_status_t st = tp_device_alloc(a->device, a->device_id, total ? total : TP_DEVICE_ALIGN, &p);
  if (st != TP_SUCCESS) {
    tp_error_prefix("%s (%zu bytes)", what, total);
    return st;
  }
  a->base = p;
  a->cap = total;
  return TP_SUCCESS;
}

/* The next slice of nbytes (as planned with tp_arena_add: the caller keeps the order). */
static inline void *tp_arena_take(tp_arena_t *a, size_t nbytes) {
  size_t r = ((nbytes ? nbytes : 1) + TP_DEVICE_ALIGN - 1) / TP_DEVICE_ALIGN * TP_DEVICE_ALIGN;
  void *p = a->base + a->used;
  a->used += r;
  return p;
}

static inline void *tp_arena_take_n(tp_arena_t *a, int64_t n, size_t elem) {
  return tp_arena_take(a, (size_t)n * elem);
}

static inline void tp_arena_release(tp_arena_t *a) {
  if (a->base) tp_device_free(a->device, a->device_id, a->base);
  a->base = NULL;
  a->cap = a->used = 0;
}

#endif
