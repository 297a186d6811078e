/* The device registry: the CPU's table is built in; another device's table (CUDA's,
 * from the plugin: cuda/cuda_load.c) is registered at run time with tp_device_register,
 * once per type, under a lock, before its first use. */
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>

#include "device_impl.h"

static const tp_device_ops *registry_slots[TP_NUM_DEVICE_TYPES] = {
    [TP_DEVICE_CPU] = &tp_cpu_device_ops,
};
static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;

/* A slot is written once (release) and read without the lock (acquire). */
static inline const tp_device_ops *slot(int d) { return __atomic_load_n(&registry_slots[d], __ATOMIC_ACQUIRE); }

tp_status_t tp_device_register(const tp_device_ops *ops) {
  if (!ops || (unsigned)ops->type >= TP_NUM_DEVICE_TYPES || !ops->name || !ops->available || !ops->count ||
      !ops->alloc || !ops->free || !ops->copy || !ops->copy_2d || !ops->memset || !ops->sync || !ops->owns)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "device_register: %s table lacks a required entry",
                        ops && ops->name ? ops->name : "a device");
  pthread_mutex_lock(&registry_lock);
  const tp_device_ops *cur = registry_slots[ops->type];
  if (!cur) __atomic_store_n(&registry_slots[ops->type], ops, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&registry_lock);
  if (cur && cur != ops)
    return tp_set_error(TP_ERR_INVALID_USAGE, "device_register: a %s table is registered already",
                        tp_device_name(ops->type));
  return TP_SUCCESS;
}

const char *tp_device_name(tp_device_t d) {
  switch (d) {
    case TP_DEVICE_CPU: return "cpu";
    case TP_DEVICE_CUDA: return "cuda";
    default: return "invalid";
  }
}

const tp_device_ops *tp_device_ops_of(tp_device_t d) {
  if ((unsigned)d >= TP_NUM_DEVICE_TYPES) return NULL;
  const tp_device_ops *ops = slot(d);
  return ops && ops->available() ? ops : NULL;
}

int tp_device_available(tp_device_t d) { return tp_device_ops_of(d) != NULL; }

/* The first use of CUDA loads the plugin (tp_cuda_load of tpcore/device.h, in cuda/cuda_load.c);
 * its failure is the reason given. */
static tp_status_t need(tp_device_t d, const char *op, const tp_device_ops **out) {
  if (d == TP_DEVICE_CUDA && !slot(d)) (void)tp_cuda_load(NULL);
  *out = tp_device_ops_of(d);
  if (*out) return TP_SUCCESS;
  if ((unsigned)d >= TP_NUM_DEVICE_TYPES)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: device type %d is not a tp_device_t", op, (int)d);
  if (d == TP_DEVICE_CUDA)
    return tp_set_error(TP_ERR_UNSUPPORTED, "%s: no cuda device is usable in this process: %s", op, tp_cuda_status());
  if (!slot(d))
    return tp_set_error(TP_ERR_UNSUPPORTED, "%s: this build of tpcore has no %s support", op, tp_device_name(d));
  return tp_set_error(TP_ERR_UNSUPPORTED, "%s: no %s device is available in this process", op, tp_device_name(d));
}

tp_status_t tp_device_alloc(tp_device_t d, int id, size_t nbytes, void **ptr) {
  if (!ptr) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "device_alloc: ptr is NULL");
  *ptr = NULL;
  const tp_device_ops *ops;
  TP_CHECK(need(d, "device_alloc", &ops));
  return ops->alloc(id, nbytes ? nbytes : 1, ptr);
}

void tp_device_free(tp_device_t d, int id, void *ptr) {
  if (!ptr || (unsigned)d >= TP_NUM_DEVICE_TYPES || !slot(d)) return;
  slot(d)->free(id, ptr);
}

/* The table that performs a copy between dst_device and src_device: the non-host side's. */
static tp_status_t copy_ops(const char *op, tp_device_t dd, tp_device_t sd, const tp_device_ops **ops) {
  if ((unsigned)dd >= TP_NUM_DEVICE_TYPES || (unsigned)sd >= TP_NUM_DEVICE_TYPES) /* before the kinds are compared */
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: device type %d is not a tp_device_t", op,
                        (int)((unsigned)dd >= TP_NUM_DEVICE_TYPES ? dd : sd));
  if (dd != TP_DEVICE_CPU && sd != TP_DEVICE_CPU && dd != sd)
    return tp_set_error(TP_ERR_UNSUPPORTED, "%s: no copy between %s and %s memory", op, tp_device_name(dd),
                        tp_device_name(sd));
  return need(dd != TP_DEVICE_CPU ? dd : sd, op, ops);
}

tp_status_t tp_device_copy(tp_device_t dd, void *dst, tp_device_t sd, const void *src, size_t nbytes,
                           tp_stream_t stream) {
  if (!nbytes) return TP_SUCCESS;
  if (!dst || !src) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "device_copy: NULL buffer for %zu bytes", nbytes);
  const tp_device_ops *ops;
  TP_CHECK(copy_ops("device_copy", dd, sd, &ops));
  TP_CHECK(tp_check_stream("device_copy", ops->type, stream));
  return ops->copy(dst, dd == TP_DEVICE_CPU, src, sd == TP_DEVICE_CPU, nbytes, stream);
}

tp_status_t tp_device_copy_2d(tp_device_t dd, void *dst, size_t dpitch, tp_device_t sd, const void *src, size_t spitch,
                              size_t width, size_t rows, tp_stream_t stream) {
  if (!width || !rows) return TP_SUCCESS;
  if (!dst || !src) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "device_copy_2d: NULL buffer");
  if (dpitch < width || spitch < width)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "device_copy_2d: pitches %zu and %zu are below the width %zu", dpitch,
                        spitch, width);
  size_t dspan, sspan; /* (rows - 1) * pitch + width bytes on each side */
  if (!tp_mul_size(rows - 1, dpitch, &dspan) || !tp_add_size(dspan, width, &dspan) ||
      !tp_mul_size(rows - 1, spitch, &sspan) || !tp_add_size(sspan, width, &sspan))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "device_copy_2d: %zu rows at pitches %zu and %zu overflow a size",
                        rows, dpitch, spitch);
  const tp_device_ops *ops;
  TP_CHECK(copy_ops("device_copy_2d", dd, sd, &ops));
  TP_CHECK(tp_check_stream("device_copy_2d", ops->type, stream));
  return ops->copy_2d(dst, dpitch, dd == TP_DEVICE_CPU, src, spitch, sd == TP_DEVICE_CPU, width, rows, stream);
}

tp_status_t tp_device_memset(tp_device_t d, void *dst, int value, size_t nbytes, tp_stream_t stream) {
  if (!nbytes) return TP_SUCCESS;
  if (!dst) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "device_memset: NULL buffer for %zu bytes", nbytes);
  const tp_device_ops *ops;
  TP_CHECK(need(d, "device_memset", &ops));
  TP_CHECK(tp_check_stream("device_memset", d, stream));
  return ops->memset(dst, value, nbytes, stream);
}

tp_status_t tp_device_sync(tp_device_t d, int id, tp_stream_t stream) {
  const tp_device_ops *ops;
  TP_CHECK(need(d, "device_sync", &ops));
  TP_CHECK(tp_check_stream("device_sync", d, stream));
  return ops->sync(id, stream);
}

void tp_pointer_device(const void *ptr, tp_device_t *device, int *device_id) {
  tp_device_t d = TP_DEVICE_CPU;
  int id = 0;
  for (int i = 0; ptr && i < TP_NUM_DEVICE_TYPES; i++) {
    const tp_device_ops *ops = slot(i);
    int did = 0;
    if (ops && ops->owns && ops->available() && ops->owns(ptr, &did)) {
      d = (tp_device_t)i;
      id = did;
      break;
    }
  }
  if (device) *device = d;
  if (device_id) *device_id = id;
}

tp_status_t tp_check_device(const char *op, const char *arg, const tp_tensor *t, tp_device_t device, int device_id) {
  if (t->device == device && (device == TP_DEVICE_CPU || t->device_id == device_id)) return TP_SUCCESS;
  if ((unsigned)t->device >= TP_NUM_DEVICE_TYPES)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s has device %d, which is not a tp_device_t", op, arg,
                        (int)t->device);
  char want[32], got[32];
  snprintf(want, sizeof want, device == TP_DEVICE_CPU ? "%s" : "%s:%d", tp_device_name(device), device_id);
  snprintf(got, sizeof got, t->device == TP_DEVICE_CPU ? "%s" : "%s:%d", tp_device_name(t->device), t->device_id);
  return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s is %s memory, but this call runs on %s", op, arg, got, want);
}

/* The stream entries: a device without them (the CPU) has nothing queued. */
tp_status_t tp_device_set_current(tp_device_t d, int id) {
  const tp_device_ops *ops;
  TP_CHECK(need(d, "device_set_current", &ops));
  return ops->set_current ? ops->set_current(id) : TP_SUCCESS;
}

tp_status_t tp_device_query(tp_device_t d, int id, tp_stream_t stream, int *done) {
  if (!done) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "device_query: done is NULL");
  *done = 0;
  const tp_device_ops *ops;
  TP_CHECK(need(d, "device_query", &ops));
  TP_CHECK(tp_check_stream("device_query", d, stream));
  if (!ops->query) {
    *done = 1;
    return TP_SUCCESS;
  }
  return ops->query(id, stream, done);
}

tp_status_t tp_device_stream_wait(tp_device_t d, int id, tp_stream_t waiter, tp_stream_t producer) {
  const tp_device_ops *ops;
  TP_CHECK(need(d, "device_stream_wait", &ops));
  TP_CHECK(tp_check_stream("device_stream_wait", d, waiter));
  TP_CHECK(tp_check_stream("device_stream_wait", d, producer));
  if (!ops->stream_wait || waiter == producer) return TP_SUCCESS;
  return ops->stream_wait(id, waiter, producer);
}

tp_status_t tp_device_mem_info(tp_device_t d, int id, size_t *free_bytes, size_t *total_bytes) {
  if (!free_bytes || !total_bytes)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "device_mem_info: free_bytes or total_bytes is NULL");
  *free_bytes = *total_bytes = 0;
  const tp_device_ops *ops;
  TP_CHECK(need(d, "device_mem_info", &ops));
  if (ops->mem_info) return ops->mem_info(id, free_bytes, total_bytes);
  long pages = sysconf(_SC_PHYS_PAGES), avail = sysconf(_SC_AVPHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || psz <= 0)
    return tp_set_error(TP_ERR_UNSUPPORTED, "device_mem_info: %s memory size unknown", tp_device_name(d));
  *total_bytes = (size_t)pages * (size_t)psz;
  *free_bytes = avail > 0 ? (size_t)avail * (size_t)psz : 0;
  return TP_SUCCESS;
}
