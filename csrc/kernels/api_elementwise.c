/* Element-wise tensor calls of the public API (include/tpcore/kernels.h): the few a model
 * outside the layers needs on any device (residual and embedding sums, gradient
 * accumulation into a shared table, zeroing), checked like the other tensor calls. */
#include "api_impl.h"

/* t as a float32 C-contiguous tensor of any shape on the call's device. */
static tp_status_t any_f32(tp_kcall *c, const char *name, const tp_tensor *t) {
  if (!t) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s is NULL (NULL argument)", c->op, name);
  int64_t shape[TP_MAX_DIMS];
  if (t->ndim < 0 || t->ndim > TP_MAX_DIMS)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s has %d dimensions (0 to %d)", c->op, name, t->ndim,
                        TP_MAX_DIMS);
  for (int i = 0; i < t->ndim; i++) shape[i] = TP_ANY;
  return tp_karg(c, name, t, 0, TP_FLOAT32, t->ndim, shape);
}

/* b has a's element count (the shapes may differ: flat element-wise). */
static tp_status_t same_count(tp_kcall *c, const char *name, const tp_tensor *b, const tp_tensor *a) {
  if (tp_tensor_numel(b) != tp_tensor_numel(a))
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "%s: %s has %lld elements, %s %lld", c->op, name,
                        (long long)tp_tensor_numel(b), "y", (long long)tp_tensor_numel(a));
  return TP_SUCCESS;
}

tp_status_t tp_add(tp_stream_t s, const tp_tensor *y, const tp_tensor *a, const tp_tensor *b) {
  tp_kcall c = {"add", TP_DEVICE_CPU, 0, 0};
  TP_CHECK(any_f32(&c, "y", y));
  TP_CHECK(any_f32(&c, "a", a));
  TP_CHECK(any_f32(&c, "b", b));
  TP_CHECK(same_count(&c, "a", a, y));
  TP_CHECK(same_count(&c, "b", b, y));
  const tp_kernel_ops *k;
  TP_CHECK(tp_kops(&c, s, &k));
  int64_t n = tp_tensor_numel(y);
  return n > 0 ? k->add(s, y->data, a->data, b->data, n) : TP_SUCCESS;
}

tp_status_t tp_fill(tp_stream_t s, const tp_tensor *y, float value) {
  tp_kcall c = {"fill", TP_DEVICE_CPU, 0, 0};
  TP_CHECK(any_f32(&c, "y", y));
  const tp_kernel_ops *k;
  TP_CHECK(tp_kops(&c, s, &k));
  int64_t n = tp_tensor_numel(y);
  return n > 0 ? k->fill(s, y->data, value, n) : TP_SUCCESS;
}
