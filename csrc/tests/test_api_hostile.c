/*
 * Hostile arguments to every public entry of the tensor + stream C API: the
 * layers (linear column/row, MLP, embedding, cross-entropy, block with its cache), the
 * kernels, the device table, the shard split and the collectives.  Each bad call must
 * return a non-success status whose tp_last_error() names the operation and the
 * argument; zero-size calls succeed and do nothing; nothing crashes, hangs or trips
 * ASan/UBSan.  World size 1 (one process): the checks are local.
 * Kernels: test_api_hostile_kernels.c; layers: test_api_hostile_layers.c.
 * Prints one line per failure and "N passed, N failed".
 */
#include "test_api_hostile.h"
#include "tpcore/throttle.h"

static int npass, nfail;

/* Under ASan a request past its 2^40-byte limit aborts unless the allocator may return
 * NULL, as the C library's does: the device table must then report TP_ERR_NOMEM. */
const char *__asan_default_options(void);
const char *__asan_default_options(void) { return "allocator_may_return_null=1"; }

/* st must be `want` (ANY_ERR: any failure) and the sentence must hold a and b (NULL: skip). */
void expect(tp_status_t st, tp_status_t want, const char *a, const char *b, const char *src, int line) {
  const char *e = tp_last_error();
  int ok = st != TP_SUCCESS && (want == ANY_ERR || st == want) && (!a || strstr(e, a)) && (!b || strstr(e, b));
  if (ok) {
    npass++;
    return;
  }
  nfail++;
  printf("FAIL line %d: %s\n  -> %s: \"%s\" (want %s with \"%s\" and \"%s\")\n", line, src, tp_status_name(st),
         st == TP_SUCCESS ? "" : e, want == ANY_ERR ? "an error" : tp_status_name(want), a ? a : "", b ? b : "");
}
void expect_ok(tp_status_t st, const char *src, int line) {
  if (st == TP_SUCCESS) {
    npass++;
    return;
  }
  nfail++;
  printf("FAIL line %d: %s\n  -> %s: \"%s\" (want success)\n", line, src, tp_status_name(st), tp_last_error());
}
const int64_t HUGE_DIMS[3] = {(int64_t)1 << 31, (int64_t)1 << 62, INT64_MAX};
float xa[64 * 64], ya[64 * 64], wa[64 * 64], ba[64 * 64], ga[64 * 64];
int64_t tok[64];

/* ----------------------------------------------------------------- generic */

/* The hostile variants of an argument `t` of a call: run(t') must fail naming op and arg. */
typedef struct {
  const char *what;
  tp_tensor t;
  const char *sub;
  tp_status_t want;
  int loose; /* a size that may be reported through the argument it disagrees with: only the op named */
} variant;
void hostile_variants_opt(const char *op, const char *arg, tp_tensor good, call1 run, void *ctx, int line,
                          int null_ok) {
  char src[160];
  variant v[32];
  int n = 0;
  v[n++] = (variant){"NULL data", with_data(good, NULL), "NULL", TP_ERR_INVALID_ARGUMENT, 0};
  v[n++] = (variant){
      "wrong dtype",
      with_dtype(good, good.dtype == TP_FLOAT32 || good.dtype == TP_BFLOAT16 || good.dtype == TP_FLOAT16 ? TP_FLOAT64
                                                                                                         : TP_FLOAT32),
      NULL, TP_ERR_INVALID_ARGUMENT, 0};
  v[n++] = (variant){"bad dtype", with_dtype(good, (tp_dtype_t)77), NULL, TP_ERR_INVALID_ARGUMENT, 0};
  v[n++] = (variant){"ndim 0", with_ndim(good, 0), NULL, TP_ERR_INVALID_ARGUMENT, 0};
  v[n++] = (variant){"ndim -1", with_ndim(good, -1), NULL, TP_ERR_INVALID_ARGUMENT, 0};
  v[n++] = (variant){"ndim 3", good.ndim == 2 ? as3d(good) : with_ndim(good, 3), NULL, TP_ERR_INVALID_ARGUMENT, 0};
  v[n++] = (variant){"ndim 9", with_ndim(good, TP_MAX_DIMS + 1), NULL, TP_ERR_INVALID_ARGUMENT, 0};
  v[n++] = (variant){"ndim INT_MAX", with_ndim(good, INT_MAX), NULL, TP_ERR_INVALID_ARGUMENT, 0};
  v[n++] = (variant){"negative dim", with_shape(good, 0, -1), NULL, TP_ERR_INVALID_ARGUMENT, 1};
  v[n++] = (variant){"INT64_MIN dim", with_shape(good, 0, INT64_MIN), NULL, TP_ERR_INVALID_ARGUMENT, 1};
  for (int h = 1; h < 3; h++) /* 2^62, INT64_MAX rows (2^31 rows of a few columns is a valid view) */
    v[n++] = (variant){"huge dim", with_shape(good, 0, HUGE_DIMS[h]), NULL, TP_ERR_INVALID_ARGUMENT, 1};
  if (good.ndim == 2) {
    tp_tensor o = with_shape(with_shape(good, 0, (int64_t)1 << 40), 1, (int64_t)1 << 40); /* 2^80 elements */
    v[n++] = (variant){"numel past int64", o, NULL, TP_ERR_INVALID_ARGUMENT, 1};
    v[n++] = (variant){"huge cols", with_shape(good, 1, INT64_MAX), NULL, TP_ERR_INVALID_ARGUMENT, 1};
    if (good.shape[1] > 1)
      v[n++] = (variant){"column stride 2", with_stride(good, 1, 2), NULL, TP_ERR_INVALID_ARGUMENT, 0};
    if (good.shape[1] > 1)
      v[n++] = (variant){"zero strides", with_stride(with_stride(good, 0, 0), 1, 0), NULL, TP_ERR_INVALID_ARGUMENT, 0};
    if (good.shape[0] > 1)
      v[n++] = (variant){"row stride 0", with_stride(good, 0, 0), NULL, TP_ERR_INVALID_ARGUMENT, 0};
    if (good.shape[0] > 1)
      v[n++] = (variant){"negative row stride", with_stride(good, 0, -good.shape[1]), NULL, TP_ERR_INVALID_ARGUMENT, 0};
  } else if (good.shape[0] > 1) {
    v[n++] = (variant){"stride 0", with_stride(good, 0, 0), NULL, TP_ERR_INVALID_ARGUMENT, 0};
    v[n++] = (variant){"stride 2", with_stride(good, 0, 2), NULL, TP_ERR_INVALID_ARGUMENT, 0};
  }
  v[n++] = (variant){"cuda tensor", with_dev(good, TP_DEVICE_CUDA, 0), "cuda", ANY_ERR, 0};
  v[n++] = (variant){"device 7", with_dev(good, (tp_device_t)7, 0), NULL, TP_ERR_INVALID_ARGUMENT, 0};
  v[n++] = (variant){"device -1", with_dev(good, (tp_device_t)-1, 0), NULL, TP_ERR_INVALID_ARGUMENT, 0};
  for (int i = 0; i < n; i++) {
    snprintf(src, sizeof src, "%s: %s %s (from line %d)", op, arg, v[i].what, line);
    tp_tensor t = v[i].t;
    expect(run(&t, ctx), v[i].want, op, v[i].loose ? NULL : arg, src, line);
  }
  if (null_ok) return;
  snprintf(src, sizeof src, "%s: %s NULL (from line %d)", op, arg, line);
  expect(run(NULL, ctx), TP_ERR_INVALID_ARGUMENT, op, arg, src, line);
}
void hostile_variants(const char *op, const char *arg, tp_tensor good, call1 run, void *ctx, int line) {
  hostile_variants_opt(op, arg, good, run, ctx, line, 0);
}

/* ------------------------------------------------------------------ devices */

static void test_devices(void) {
  void *p = NULL;
  char buf[256], dst[256];
  memset(buf, 7, sizeof buf);
  TRUE(tp_device_available(TP_DEVICE_CPU));
  TRUE(!tp_device_available(TP_DEVICE_CUDA));
  TRUE(!tp_device_available((tp_device_t)-1));
  TRUE(!tp_device_available((tp_device_t)99));
  TRUE(tp_device_ops_of((tp_device_t)99) == NULL && tp_device_ops_of((tp_device_t)-7) == NULL);
  TRUE(strcmp(tp_device_name((tp_device_t)42), "invalid") == 0);
  ARG(tp_device_alloc(TP_DEVICE_CPU, 0, 16, NULL), "device_alloc", "ptr");
  BAD(tp_device_alloc(TP_DEVICE_CUDA, 0, 16, &p), TP_ERR_UNSUPPORTED, "device_alloc", "cuda");
  TRUE(p == NULL);
  ARG(tp_device_alloc((tp_device_t)5, 0, 16, &p), "device_alloc", "device");
  ARG(tp_device_alloc((tp_device_t)-1, 0, 16, &p), "device_alloc", "device");
  BAD(tp_device_alloc(TP_DEVICE_CPU, 0, SIZE_MAX, &p), ANY_ERR, "cpu", "bytes");
  TRUE(p == NULL);
  BAD(tp_device_alloc(TP_DEVICE_CPU, 0, SIZE_MAX - 100, &p), ANY_ERR, "cpu", "bytes");
  BAD(tp_device_alloc(TP_DEVICE_CPU, 0, (size_t)1 << 62, &p), ANY_ERR, "cpu", "bytes");
  TRUE(p == NULL);
  OK(tp_device_alloc(TP_DEVICE_CPU, 0, 0, &p)); /* zero bytes: a valid pointer to free */
  TRUE(p != NULL);
  tp_device_free(TP_DEVICE_CPU, 0, p);
  tp_device_free(TP_DEVICE_CPU, 0, NULL);
  tp_device_free(TP_DEVICE_CUDA, 0, buf); /* no such table: ignored, not freed */
  tp_device_free((tp_device_t)77, 0, buf);
  OK(tp_device_alloc(TP_DEVICE_CPU, 0, 100, &p));
  tp_device_free(TP_DEVICE_CPU, 0, p);
  /* copies */
  OK(tp_device_copy(TP_DEVICE_CPU, NULL, TP_DEVICE_CPU, NULL, 0, NULL));
  ARG(tp_device_copy(TP_DEVICE_CPU, NULL, TP_DEVICE_CPU, buf, 8, NULL), "device_copy", "NULL");
  ARG(tp_device_copy(TP_DEVICE_CPU, dst, TP_DEVICE_CPU, NULL, 8, NULL), "device_copy", "NULL");
  BAD(tp_device_copy(TP_DEVICE_CUDA, dst, TP_DEVICE_CPU, buf, 8, NULL), TP_ERR_UNSUPPORTED, "device_copy", "cuda");
  BAD(tp_device_copy(TP_DEVICE_CPU, dst, TP_DEVICE_CUDA, buf, 8, NULL), TP_ERR_UNSUPPORTED, "device_copy", "cuda");
  ARG(tp_device_copy((tp_device_t)9, dst, TP_DEVICE_CPU, buf, 8, NULL), "device_copy", "device");
  ARG(tp_device_copy(TP_DEVICE_CPU, dst, (tp_device_t)-2, buf, 8, NULL), "device_copy", "device");
  ARG(tp_device_copy(TP_DEVICE_CUDA, dst, (tp_device_t)9, buf, 8, NULL), "device_copy", "device");
  ARG(tp_device_copy((tp_device_t)9, dst, TP_DEVICE_CUDA, buf, 8, NULL), "device_copy", "device");
  OK(tp_device_copy(TP_DEVICE_CPU, dst, TP_DEVICE_CPU, buf, 8, NULL));
  TRUE(dst[7] == 7);
  /* 2-D copies */
  OK(tp_device_copy_2d(TP_DEVICE_CPU, NULL, 0, TP_DEVICE_CPU, NULL, 0, 0, 5, NULL));
  OK(tp_device_copy_2d(TP_DEVICE_CPU, NULL, 0, TP_DEVICE_CPU, NULL, 0, 4, 0, NULL));
  ARG(tp_device_copy_2d(TP_DEVICE_CPU, dst, 4, TP_DEVICE_CPU, buf, 8, 8, 2, NULL), "device_copy_2d", "pitch");
  ARG(tp_device_copy_2d(TP_DEVICE_CPU, dst, 8, TP_DEVICE_CPU, buf, 3, 8, 2, NULL), "device_copy_2d", "pitch");
  ARG(tp_device_copy_2d(TP_DEVICE_CPU, NULL, 8, TP_DEVICE_CPU, buf, 8, 8, 2, NULL), "device_copy_2d", "NULL");
  ARG(tp_device_copy_2d(TP_DEVICE_CPU, dst, 8, TP_DEVICE_CPU, NULL, 8, 8, 2, NULL), "device_copy_2d", "NULL");
  /* (rows - 1) * pitch + width past SIZE_MAX: refused before any byte moves */
  ARG(tp_device_copy_2d(TP_DEVICE_CPU, dst, SIZE_MAX / 2, TP_DEVICE_CPU, buf, 8, 8, 3, NULL), "device_copy_2d",
      "overflow");
  ARG(tp_device_copy_2d(TP_DEVICE_CPU, dst, 8, TP_DEVICE_CPU, buf, SIZE_MAX / 2, 8, 3, NULL), "device_copy_2d",
      "overflow");
  ARG(tp_device_copy_2d(TP_DEVICE_CPU, dst, 16, TP_DEVICE_CPU, buf, 16, 16, SIZE_MAX / 8, NULL), "device_copy_2d",
      "overflow");
  ARG(tp_device_copy_2d(TP_DEVICE_CPU, dst, SIZE_MAX, TP_DEVICE_CPU, buf, SIZE_MAX, SIZE_MAX, 2, NULL),
      "device_copy_2d", "overflow");
  BAD(tp_device_copy_2d(TP_DEVICE_CUDA, dst, 8, TP_DEVICE_CPU, buf, 8, 8, 2, NULL), TP_ERR_UNSUPPORTED,
      "device_copy_2d", "cuda");
  ARG(tp_device_copy_2d((tp_device_t)3, dst, 8, TP_DEVICE_CPU, buf, 8, 8, 2, NULL), "device_copy_2d", "device");
  memset(dst, 0, sizeof dst);
  OK(tp_device_copy_2d(TP_DEVICE_CPU, dst, 16, TP_DEVICE_CPU, buf, 8, 4, 3, NULL));
  TRUE(dst[0] == 7 && dst[3] == 7 && dst[4] == 0 && dst[32 + 3] == 7 && dst[36] == 0);
  /* memset / sync */
  OK(tp_device_memset(TP_DEVICE_CPU, NULL, 0, 0, NULL));
  ARG(tp_device_memset(TP_DEVICE_CPU, NULL, 0, 8, NULL), "device_memset", "NULL");
  BAD(tp_device_memset(TP_DEVICE_CUDA, dst, 0, 8, NULL), TP_ERR_UNSUPPORTED, "device_memset", "cuda");
  ARG(tp_device_memset((tp_device_t)4, dst, 0, 8, NULL), "device_memset", "device");
  OK(tp_device_sync(TP_DEVICE_CPU, 0, NULL));
  BAD(tp_device_sync(TP_DEVICE_CUDA, 0, NULL), TP_ERR_UNSUPPORTED, "device_sync", "cuda");
  ARG(tp_device_sync((tp_device_t)-3, 0, NULL), "device_sync", "device");
  tp_device_t d = (tp_device_t)9;
  int id = 9;
  tp_pointer_device(NULL, &d, &id);
  TRUE(d == TP_DEVICE_CPU && id == 0);
  tp_pointer_device(buf, NULL, NULL);
  /* tensor helpers on hostile views */
  tp_tensor t = T2(buf, 2, 3);
  TRUE(tp_tensor_numel(P(with_ndim(t, 9))) == -1);
  TRUE(tp_tensor_numel(P(with_ndim(t, -1))) == -1);
  TRUE(tp_tensor_numel(P(with_shape(t, 0, -2))) == -1);
  TRUE(tp_tensor_numel(P(with_shape(with_shape(t, 0, INT64_MAX), 1, 2))) == -1);
  TRUE(tp_tensor_numel(P(with_ndim(t, 0))) == 1);
  TRUE(!tp_tensor_is_contiguous(P(with_ndim(t, 9))));
  TRUE(!tp_tensor_is_contiguous(P(with_ndim(t, INT_MAX))));
  TRUE(!tp_tensor_is_contiguous(P(with_stride(t, 1, 0))));
}

/* ---------------------------------------------------------------- partition */

static void test_partition(void) {
  int64_t sizes[8], offs[9], parts[4], po[5];
  OK(tp_partition(0, 3, NULL, 1, sizes, offs));
  TRUE(sizes[0] == 0 && offs[3] == 0);
  OK(tp_partition(10, 3, NULL, 1, NULL, NULL));
  ARG(tp_partition(-1, 2, NULL, 1, sizes, offs), "partition", "n");
  ARG(tp_partition(INT64_MIN, 2, NULL, 1, sizes, offs), "partition", "n");
  ARG(tp_partition(10, 0, NULL, 1, sizes, offs), "partition", "world");
  ARG(tp_partition(10, -5, NULL, 1, sizes, offs), "partition", "world");
  ARG(tp_partition(10, INT_MIN, NULL, 1, sizes, offs), "partition", "world");
  ARG(tp_partition(10, 2, NULL, 0, sizes, offs), "partition", "align");
  ARG(tp_partition(10, 2, NULL, -2, sizes, offs), "partition", "align");
  ARG(tp_partition(10, 2, NULL, INT64_MIN, sizes, offs), "partition", "align");
  ARG(tp_partition(10, 2, NULL, 3, sizes, offs), "partition", "align");
  OK(tp_partition(INT64_MAX, 3, NULL, 1, sizes, offs));
  TRUE(offs[3] == INT64_MAX && sizes[0] + sizes[1] + sizes[2] == INT64_MAX);
  OK(tp_partition(INT64_MAX, 1, NULL, INT64_MAX, sizes, offs));
  double wbad[2][3] = {{1, -1, 1}, {0, 0, 0}};
  double wnan[2] = {1, 0.0 / 0.0}, winf[2] = {1, 1.0 / 0.0};
  for (int i = 0; i < 2; i++) ARG(tp_partition(12, 3, wbad[i], 1, sizes, offs), "partition", "weights");
  ARG(tp_partition(12, 2, wnan, 1, sizes, offs), "partition", "weights");
  ARG(tp_partition(12, 2, winf, 1, sizes, offs), "partition", "weights");
  /* weighted splits are computed in double; whatever the size or the weights' range, the sizes are
   * >= 0 and tile n (before: garbage sizes and overflowing double -> int64 conversions) */
  double w3[3] = {1, 2, 3}, whuge[3] = {1, 1e308, 1e308}, wtiny[3] = {1e-300, 1e-300, 1e300}, wbig[2] = {1e308, 1e-300};
  struct {
    int64_t n;
    int world;
    const double *w;
  } cases[] = {{INT64_MAX, 3, w3},           {((int64_t)1 << 53) + 2, 3, w3}, {(int64_t)1 << 53, 3, w3}, {12, 3, whuge},
               {(int64_t)1 << 50, 3, wtiny}, {(int64_t)1 << 50, 2, wbig},     {INT64_MAX, 3, whuge}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    OK(tp_partition(cases[i].n, cases[i].world, cases[i].w, 1, sizes, offs));
    int64_t sum = 0;
    int ok = 1;
    for (int r = 0; r < cases[i].world; r++) {
      ok = ok && sizes[r] >= 0 && offs[r] == sum;
      sum += sizes[r];
    }
    TRUE(ok && sum == cases[i].n && offs[cases[i].world] == cases[i].n);
  }
  OK(tp_partition(12, 3, wtiny, 1, sizes, offs));
  TRUE(offs[3] == 12 && sizes[0] == 0 && sizes[1] == 0 && sizes[2] == 12);
  /* tp_partition_sizes */
  const int64_t neg[2] = {5, -1}, big[2] = {INT64_MAX, 1}, wrong[2] = {3, 3}, huge2[2] = {INT64_MAX, INT64_MAX};
  ARG(tp_partition_sizes(5, 2, neg, parts, po, "linear: partition", "out_features"), "linear: partition", "[1]");
  ARG(tp_partition_sizes(5, 2, big, parts, po, "linear: partition", "out_features"), "linear: partition", "2^63");
  ARG(tp_partition_sizes(5, 2, huge2, parts, po, "linear: partition", "out_features"), "linear: partition", "2^63");
  ARG(tp_partition_sizes(5, 2, wrong, parts, po, "linear: partition", "out_features"), "linear: partition",
      "out_features");
  ARG(tp_partition_sizes(-1, 2, NULL, parts, po, "linear: partition", "out_features"), "linear: partition", "dim");
  ARG(tp_partition_sizes(5, 0, NULL, parts, po, "linear: partition", "out_features"), "linear: partition", "world");
  ARG(tp_partition_sizes(5, -1, wrong, parts, po, "linear: partition", "out_features"), "linear: partition", "world");
  BAD(tp_partition_sizes(5, 2, wrong, parts, po, NULL, NULL), TP_ERR_INVALID_ARGUMENT, NULL, NULL);
  OK(tp_partition_sizes(0, 4, NULL, parts, po, "x", "y"));
  TRUE(po[4] == 0);
  OK(tp_partition_sizes(INT64_MAX, 2, NULL, NULL, NULL, "x", "y"));
}

/* ---------------------------------------------------------------- throttle */

static void test_throttle(void) {
  const double bad[] = {0.5, 0.0, -1.0, 0.0 / 0.0, 1.0 / 0.0, -1.0 / 0.0, 1000.5, 1e300};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    ARG(tp_set_throttle(bad[i]), "set_throttle", "factor");
    TRUE(tp_get_throttle() == 1.0); /* a refused factor leaves the throttle as it was */
  }
  OK(tp_set_throttle(2.5));
  TRUE(tp_get_throttle() == 2.5);
  ARG(tp_set_throttle(0.99), "set_throttle", "[1, 1000]");
  TRUE(tp_get_throttle() == 2.5);
  OK(tp_set_throttle(1000.0));
  OK(tp_set_throttle(1.0));
  TRUE(tp_get_throttle() == 1.0);
}

/* ------------------------------------------------------------- collectives */

static void test_collectives(tp_comm_t comm) {
  float s[8] = {1, 2, 3, 4, 5, 6, 7, 8}, r[8];
  size_t counts[1] = {4}, bigc[1] = {SIZE_MAX};
  tp_stream_t fs = fake_stream();
  unsigned mask = 0;
  OK(tp_comm_devices(comm, &mask));
  TRUE(mask == (1u << TP_DEVICE_CPU));
  ARG(tp_comm_devices(comm, NULL), "devices", "NULL");
  BAD(tp_comm_devices(NULL, &mask), ANY_ERR, "devices", "comm");
  /* a stream on a host backend: an argument error naming the call and the stream */
  ARG(tp_all_reduce(s, r, 4, TP_FLOAT32, TP_SUM, comm, fs), "all_reduce", "stream");
  ARG(tp_all_gather(s, r, 4, TP_FLOAT32, comm, fs), "all_gather", "stream");
  ARG(tp_all_gather_v(s, r, counts, TP_FLOAT32, comm, fs), "all_gather", "stream");
  ARG(tp_reduce_scatter(s, r, 4, TP_FLOAT32, TP_SUM, comm, fs), "reduce_scatter", "stream");
  ARG(tp_reduce_scatter_v(s, r, counts, TP_FLOAT32, TP_SUM, comm, fs), "reduce_scatter", "stream");
  ARG(tp_broadcast(s, r, 4, TP_FLOAT32, 0, comm, fs), "broadcast", "stream");
  ARG(tp_reduce(s, r, 4, TP_FLOAT32, TP_SUM, 0, comm, fs), "reduce", "stream");
  ARG(tp_all_to_all(s, counts, r, counts, TP_FLOAT32, comm, fs), "all_to_all", "stream");
  ARG(tp_barrier(comm, fs), "barrier", "stream");
  ARG(tp_send(s, 4, TP_FLOAT32, 0, comm, fs), "send", NULL); /* world 1: peer 0 is this rank (refused first) */
  ARG(tp_recv(r, 4, TP_FLOAT32, 0, comm, fs), "recv", NULL);
  ARG(tp_sendrecv(s, 4, 0, r, 4, 0, TP_FLOAT32, comm, fs), "sendrecv", "stream");
  /* the communicator still works after those */
  OK(tp_all_reduce(s, r, 4, TP_FLOAT32, TP_SUM, comm, NULL));
  TRUE(r[3] == 4);
  /* zero counts succeed with NULL buffers */
  OK(tp_all_reduce(NULL, NULL, 0, TP_FLOAT32, TP_SUM, comm, NULL));
  OK(tp_all_gather(NULL, NULL, 0, TP_FLOAT32, comm, NULL));
  OK(tp_broadcast(NULL, NULL, 0, TP_FLOAT32, 0, comm, NULL));
  /* NULL buffers, bad dtype/op/root, counts past the address space */
  ARG(tp_all_reduce(NULL, r, 4, TP_FLOAT32, TP_SUM, comm, NULL), "all_reduce", "send");
  ARG(tp_all_reduce(s, NULL, 4, TP_FLOAT32, TP_SUM, comm, NULL), "all_reduce", "recv");
  ARG(tp_all_reduce(s, r, 4, (tp_dtype_t)99, TP_SUM, comm, NULL), "all_reduce", "dtype");
  ARG(tp_all_reduce(s, r, 4, TP_FLOAT32, (tp_redop_t)-1, comm, NULL), "all_reduce", "op");
  ARG(tp_all_reduce(s, r, SIZE_MAX, TP_FLOAT32, TP_SUM, comm, NULL), "all_reduce", "count");
  ARG(tp_all_reduce(s, r, SIZE_MAX / 4 + 1, TP_FLOAT32, TP_SUM, comm, NULL), "all_reduce", "count");
  ARG(tp_all_gather(s, r, SIZE_MAX / 2, TP_FLOAT64, comm, NULL), "all_gather", "count");
  ARG(tp_all_gather_v(s, r, NULL, TP_FLOAT32, comm, NULL), "all_gather", "counts");
  ARG(tp_all_gather_v(s, r, bigc, TP_FLOAT32, comm, NULL), "all_gather", "count");
  ARG(tp_reduce_scatter_v(s, r, bigc, TP_FLOAT32, TP_SUM, comm, NULL), "reduce_scatter", "count");
  ARG(tp_reduce_scatter(s, r, SIZE_MAX, TP_FLOAT32, TP_SUM, comm, NULL), "reduce_scatter", "count");
  /* all_to_all (world 1): NULL counts, totals past the address space, this rank's block to itself
   * of two sizes, NULL buffers, overlapping buffers; then a good call and an empty one */
  size_t c3[1] = {3}, c0[1] = {0};
  ARG(tp_all_to_all(s, NULL, r, counts, TP_FLOAT32, comm, NULL), "all_to_all", "send_counts");
  ARG(tp_all_to_all(s, counts, r, NULL, TP_FLOAT32, comm, NULL), "all_to_all", "recv_counts");
  ARG(tp_all_to_all(s, bigc, r, bigc, TP_FLOAT32, comm, NULL), "all_to_all", "send_counts");
  ARG(tp_all_to_all(s, counts, r, c3, TP_FLOAT32, comm, NULL), "all_to_all", "recv_counts[0] is 3");
  ARG(tp_all_to_all(s, counts, r, counts, (tp_dtype_t)99, comm, NULL), "all_to_all", "dtype");
  ARG(tp_all_to_all(NULL, counts, r, counts, TP_FLOAT32, comm, NULL), "all_to_all", "send");
  ARG(tp_all_to_all(s, counts, NULL, counts, TP_FLOAT32, comm, NULL), "all_to_all", "recv");
  ARG(tp_all_to_all(s, counts, s + 2, counts, TP_FLOAT32, comm, NULL), "all_to_all", "overlap");
  BAD(tp_all_to_all(s, counts, r, counts, TP_FLOAT32, NULL, NULL), ANY_ERR, "all_to_all", "comm");
  OK(tp_all_to_all(s + 4, counts, r, counts, TP_FLOAT32, comm, NULL));
  TRUE(r[0] == 5 && r[3] == 8);
  OK(tp_all_to_all(NULL, c0, NULL, c0, TP_FLOAT32, comm, NULL));
  ARG(tp_broadcast(s, r, 4, TP_FLOAT32, 1, comm, NULL), "broadcast", "root");
  ARG(tp_broadcast(s, r, 4, TP_FLOAT32, -1, comm, NULL), "broadcast", "root");
  ARG(tp_reduce(s, r, 4, TP_FLOAT32, TP_SUM, INT_MAX, comm, NULL), "reduce", "root");
  ARG(tp_send(s, 4, TP_FLOAT32, 5, comm, NULL), "send", "peer");
  ARG(tp_recv(r, 4, TP_FLOAT32, -1, comm, NULL), "recv", "peer");
  ARG(tp_send(NULL, 4, TP_FLOAT32, 0, comm, NULL), "send", NULL);
  ARG(tp_send(s, SIZE_MAX, TP_FLOAT32, 0, comm, NULL), "send", NULL);
  ARG(tp_sendrecv(s, 4, 3, r, 4, 0, TP_FLOAT32, comm, NULL), "sendrecv", NULL);
  BAD(tp_all_reduce(s, r, 4, TP_FLOAT32, TP_SUM, NULL, NULL), ANY_ERR, "all_reduce", "comm");
  BAD(tp_barrier(NULL, NULL), ANY_ERR, "barrier", "comm");
  OK(tp_all_reduce(s, r, 4, TP_FLOAT32, TP_SUM, comm, NULL));
}

/* The CPU runs every call synchronously: a stream given with host memory (e.g. a CUDA stream
 * passed with the wrong tensors) is refused at every boundary, naming the call. */
static void test_cpu_streams(tp_comm_t comm) {
  tp_stream_t fs = fake_stream();
  float x[6] = {1, 2, 3, 4, 5, 6}, w[6] = {1, 0, 0, 1, 1, 1}, y[4];
  ARG(tp_linear_forward(fs, P(T2(y, 2, 2)), P(T2(x, 2, 3)), P(T2(w, 2, 3)), NULL), "linear_forward", "stream");
  ARG(tp_device_copy(TP_DEVICE_CPU, y, TP_DEVICE_CPU, x, 16, fs), "device_copy", "stream");
  ARG(tp_device_copy_2d(TP_DEVICE_CPU, y, 8, TP_DEVICE_CPU, x, 12, 8, 2, fs), "device_copy_2d", "stream");
  ARG(tp_device_memset(TP_DEVICE_CPU, y, 0, 16, fs), "device_memset", "stream");
  ARG(tp_device_sync(TP_DEVICE_CPU, 0, fs), "device_sync", "stream");
  tp_linear_config_t cfg = TP_LINEAR_CONFIG_INITIALIZER;
  cfg.in_features = 3;
  cfg.out_features = 2;
  tp_parallel_linear_t L = NULL;
  OK(tp_parallel_linear_create(&L, comm, &cfg));
  if (!L) return;
  ARG(tp_parallel_linear_forward(L, P(T2(y, 2, 2)), P(T2(x, 2, 3)), fs), "linear forward", "stream");
  OK(tp_parallel_linear_forward(L, P(T2(y, 2, 2)), P(T2(x, 2, 3)), NULL));
  tp_parallel_linear_destroy(L);
}

int main(void) {
  char job[64];
  snprintf(job, sizeof job, "hostile_%d", (int)getpid());
  tp_comm_config_t cc = TP_COMM_CONFIG_INITIALIZER;
  cc.job_id = job;
  cc.timeout_s = 30;
  tp_comm_t comm;
  if (tp_comm_init_rank(&comm, 1, 0, &cc) != TP_SUCCESS) {
    printf("init: %s\n0 passed, 1 failed\n", tp_last_error());
    return 1;
  }
  test_devices();
  printf("devices: done\n");
  test_partition();
  printf("partition: done\n");
  test_throttle();
  printf("throttle: done\n");
  test_kernels();
  printf("kernels: done\n");
  test_collectives(comm);
  printf("collectives: done\n");
  test_cpu_streams(comm);
  printf("cpu streams: done\n");
  test_linear(comm, TP_COLUMN_PARALLEL);
  test_linear(comm, TP_ROW_PARALLEL);
  test_mlp(comm);
  test_vocab(comm);
  test_block(comm);
  tp_comm_destroy(comm);
  printf("%d passed, %d failed\n", npass, nfail);
  return nfail ? 1 : 0;
}
