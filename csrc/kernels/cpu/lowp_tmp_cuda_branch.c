/* TEMPORARY (branch i10b-cuda only, drop at merge): placeholders for the CPU
 * low-precision entries, which branch i10b-cpu implements, so that this branch's C core
 * links while the CUDA side is written.  Every one refuses with an error. */
#include "cpu_impl.h"

static tp_status_t refuse(const char *op) {
  return tp_set_error(TP_ERR_UNSUPPORTED, "cpu %s: not in this branch (i10b-cpu implements it)", op);
}

tp_status_t tp_cpu_convert(tp_stream_t s, void *y, tp_dtype_t ydt, const void *x, tp_dtype_t xdt, int64_t n) {
  (void)s, (void)y, (void)ydt, (void)x, (void)xdt, (void)n;
  return refuse("convert");
}

size_t tp_cpu_linear_lp_workspace(int64_t M, int64_t K, int64_t N, tp_dtype_t wdt, int backward) {
  (void)M, (void)K, (void)N, (void)wdt, (void)backward;
  return 0;
}

tp_status_t tp_cpu_linear_forward_lp(tp_stream_t s, float *y, const float *x, const void *w, tp_dtype_t wdt,
                                     const float *b, int64_t M, int64_t K, int64_t N, void *workspace,
                                     size_t workspace_bytes) {
  (void)s, (void)y, (void)x, (void)w, (void)wdt, (void)b, (void)M, (void)K, (void)N, (void)workspace,
      (void)workspace_bytes;
  return refuse("linear_forward_lp");
}

tp_status_t tp_cpu_linear_backward_lp(tp_stream_t s, float *dx, float *dw, float *db, const float *dy,
                                      const float *x, const void *w, tp_dtype_t wdt, int64_t M, int64_t K, int64_t N,
                                      int accumulate_dx, void *workspace, size_t workspace_bytes) {
  (void)s, (void)dx, (void)dw, (void)db, (void)dy, (void)x, (void)w, (void)wdt, (void)M, (void)K, (void)N,
      (void)accumulate_dx, (void)workspace, (void)workspace_bytes;
  return refuse("linear_backward_lp");
}

tp_status_t tp_cpu_embedding_forward_lp(tp_stream_t s, float *out, const int64_t *tokens, const void *table,
                                        tp_dtype_t wdt, int64_t M, int64_t lo, int64_t V, int64_t C) {
  (void)s, (void)out, (void)tokens, (void)table, (void)wdt, (void)M, (void)lo, (void)V, (void)C;
  return refuse("embedding_forward_lp");
}
