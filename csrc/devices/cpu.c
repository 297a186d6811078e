/* The CPU's device table: host memory, synchronous copies. */
#include <stdlib.h>
#include <string.h>

#include "device_impl.h"

static int cpu_available(void) { return 1; }
static int cpu_count(void) { return 1; }

static tp_status_t cpu_alloc(int device_id, size_t nbytes, void **ptr) {
  (void)device_id;
  size_t rounded;
  if (!tp_add_size(nbytes, TP_DEVICE_ALIGN - 1, &rounded))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "cpu: %zu bytes overflow a size", nbytes);
  rounded -= rounded % TP_DEVICE_ALIGN;
  void *p = aligned_alloc(TP_DEVICE_ALIGN, rounded ? rounded : TP_DEVICE_ALIGN);
  if (!p) return tp_set_error(TP_ERR_NOMEM, "cpu: out of memory allocating %zu bytes", nbytes);
  *ptr = p;
  return TP_SUCCESS;
}

static void cpu_free(int device_id, void *ptr) {
  (void)device_id;
  free(ptr);
}

static tp_status_t cpu_copy(void *dst, int dst_host, const void *src, int src_host, size_t nbytes, tp_stream_t stream) {
  (void)dst_host, (void)src_host, (void)stream;
  if (nbytes && dst != src) memmove(dst, src, nbytes);
  return TP_SUCCESS;
}

static tp_status_t cpu_copy_2d(void *dst, size_t dpitch, int dst_host, const void *src, size_t spitch, int src_host,
                               size_t width, size_t rows, tp_stream_t stream) {
  (void)dst_host, (void)src_host, (void)stream;
  if (!width || !rows) return TP_SUCCESS;
  if (dpitch == width && spitch == width) {
    memmove(dst, src, width * rows);
    return TP_SUCCESS;
  }
  for (size_t r = 0; r < rows; r++) memmove((char *)dst + r * dpitch, (const char *)src + r * spitch, width);
  return TP_SUCCESS;
}

static tp_status_t cpu_memset(void *dst, int value, size_t nbytes, tp_stream_t stream) {
  (void)stream;
  if (nbytes) memset(dst, value, nbytes);
  return TP_SUCCESS;
}

static tp_status_t cpu_sync(int device_id, tp_stream_t stream) {
  (void)device_id, (void)stream;
  return TP_SUCCESS;
}

const tp_device_ops tp_cpu_device_ops = {
    .type = TP_DEVICE_CPU,
    .name = "cpu",
    .available = cpu_available,
    .count = cpu_count,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .copy = cpu_copy,
    .copy_2d = cpu_copy_2d,
    .memset = cpu_memset,
    .sync = cpu_sync,
    .owns = NULL, /* host memory is what no other device claims */
};
