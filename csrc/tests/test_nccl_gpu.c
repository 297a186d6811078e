/*
 * The NCCL backend and the host-staged path on a GPU (run by scripts/gpu_check.sh;
 * it needs the CUDA plugin, a device, and for nccl the library):
 *
 *   test_nccl_gpu BACKEND WORLD     BACKEND: nccl or shm (shm: device buffers staged
 *                                   through host memory); WORLD ranks, forked, all on
 *                                   device LOCAL_RANK % devices (several ranks on one
 *                                   GPU need NCCL 2.30+ with NCCL_MULTI_RANK_GPU_ENABLE=1)
 *
 * Every collective of the interface on device buffers against float64 references
 * computed here, then a mismatched call (TP_ERR_MISMATCH naming both sides).  Prints
 * "<backend> world <n>: N passed, M failed" per rank; exit status 0 when all passed.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tpcore/comm.h"
#include "tpcore/device.h"

/* Weak: this file also links where the core has no CUDA loader (it then says so). */

static int passed, failed, rank_, world_, dev_;
static const char *backend_;

#define CHECK(cond, ...)                                          \
  do {                                                            \
    if (cond) passed++;                                           \
    else {                                                        \
      failed++;                                                   \
      fprintf(stderr, "rank %d FAIL line %d: ", rank_, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                               \
      fprintf(stderr, " (%s)\n", tp_last_error());                \
    }                                                             \
  } while (0)

static float val(int r, size_t i) { return (float)((r + 1) * 0.5 + (double)(i % 17) * 0.25); }

static float *dev_alloc(size_t n) {
  void *p = NULL;
  if (tp_device_alloc(TP_DEVICE_CUDA, dev_, (n ? n : 1) * sizeof(float), &p) != TP_SUCCESS) {
    fprintf(stderr, "rank %d: device_alloc: %s\n", rank_, tp_last_error());
    exit(3);
  }
  return p;
}

static void upload(float *d, const float *h, size_t n) {
  if (n) tp_device_copy(TP_DEVICE_CUDA, d, TP_DEVICE_CPU, h, n * sizeof(float), NULL);
}

static void download(float *h, const float *d, size_t n, tp_comm_t c) {
  tp_comm_sync(c, NULL);
  if (n) tp_device_copy(TP_DEVICE_CPU, h, TP_DEVICE_CUDA, d, n * sizeof(float), NULL);
  tp_device_sync(TP_DEVICE_CUDA, dev_, NULL);
}

static int close_to(const float *got, const double *want, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (fabs(got[i] - want[i]) > 1e-4 * (1 + fabs(want[i]))) {
      fprintf(stderr, "rank %d: [%zu] = %g, want %g\n", rank_, i, got[i], want[i]);
      return 0;
    }
  return 1;
}

static void test_all_reduce(tp_comm_t c, size_t n) {
  float *h = malloc((n + 1) * sizeof(float)), *d = dev_alloc(n);
  double *want = malloc((n + 1) * sizeof(double));
  tp_redop_t ops[] = {TP_SUM, TP_MAX, TP_MIN, TP_AVG, TP_PROD};
  for (int k = 0; k < 5; k++) {
    for (size_t i = 0; i < n; i++) {
      h[i] = val(rank_, i);
      double acc = val(0, i);
      for (int r = 1; r < world_; r++) {
        double v = val(r, i);
        acc = ops[k] == TP_MAX ? fmax(acc, v) : ops[k] == TP_MIN ? fmin(acc, v) : ops[k] == TP_PROD ? acc * v : acc + v;
      }
      want[i] = ops[k] == TP_AVG ? acc / world_ : acc;
    }
    upload(d, h, n);
    CHECK(tp_all_reduce(d, d, n, TP_FLOAT32, ops[k], c, NULL) == TP_SUCCESS, "all_reduce(%s) of %zu",
          tp_redop_name(ops[k]), n);
    download(h, d, n, c);
    CHECK(close_to(h, want, n), "all_reduce(%s) values", tp_redop_name(ops[k]));
  }
  tp_device_free(TP_DEVICE_CUDA, dev_, d);
  free(h), free(want);
}

/* counts[p] = base + (uneven ? p : 0) */
static void test_gather_scatter(tp_comm_t c, size_t base, int uneven) {
  size_t counts[64], total = 0, before = 0;
  for (int p = 0; p < world_; p++) counts[p] = base + (uneven ? (size_t)p : 0), total += counts[p];
  for (int p = 0; p < rank_; p++) before += counts[p];
  size_t mine = counts[rank_];
  float *h = malloc((total + 1) * sizeof(float)), *ds = dev_alloc(total), *dr = dev_alloc(total);
  double *want = malloc((total + 1) * sizeof(double));
  /* all_gather: rank p's block is val(p, i) */
  for (size_t i = 0; i < mine; i++) h[i] = val(rank_, i);
  upload(ds, h, mine);
  size_t off = 0;
  for (int p = 0; p < world_; p++)
    for (size_t i = 0; i < counts[p]; i++) want[off++] = val(p, i);
  tp_status_t st =
      uneven ? tp_all_gather_v(ds, dr, counts, TP_FLOAT32, c, NULL) : tp_all_gather(ds, dr, base, TP_FLOAT32, c, NULL);
  CHECK(st == TP_SUCCESS, "all_gather%s of %zu", uneven ? "_v" : "", base);
  download(h, dr, total, c);
  CHECK(close_to(h, want, total), "all_gather%s values", uneven ? "_v" : "");
  /* reduce_scatter(sum): element j of x on rank r is val(r, j) */
  for (size_t j = 0; j < total; j++) h[j] = val(rank_, j);
  upload(ds, h, total);
  for (size_t i = 0; i < mine; i++) {
    double acc = 0;
    for (int r = 0; r < world_; r++) acc += val(r, before + i);
    want[i] = acc;
  }
  st = uneven ? tp_reduce_scatter_v(ds, dr, counts, TP_FLOAT32, TP_SUM, c, NULL)
              : tp_reduce_scatter(ds, dr, base, TP_FLOAT32, TP_SUM, c, NULL);
  CHECK(st == TP_SUCCESS, "reduce_scatter%s of %zu", uneven ? "_v" : "", base);
  download(h, dr, mine, c);
  CHECK(close_to(h, want, mine), "reduce_scatter%s values", uneven ? "_v" : "");
  tp_device_free(TP_DEVICE_CUDA, dev_, ds);
  tp_device_free(TP_DEVICE_CUDA, dev_, dr);
  free(h), free(want);
}

/* all_to_all: rank a sends rank b (base + a + 2b) % (base + 3) elements (0 among them when
 * base is 0), element i of the block being val(10 * a + b, i). */
static void test_all_to_all(tp_comm_t c, size_t base) {
  size_t sc[64], rc[64], st_ = 0, rt = 0;
  for (int p = 0; p < world_; p++) {
    sc[p] = (base + (size_t)rank_ + 2 * (size_t)p) % (base + 3);
    rc[p] = (base + (size_t)p + 2 * (size_t)rank_) % (base + 3);
    st_ += sc[p], rt += rc[p];
  }
  float *h = malloc((st_ + rt + 1) * sizeof(float)), *ds = dev_alloc(st_), *dr = dev_alloc(rt);
  double *want = malloc((rt + 1) * sizeof(double));
  size_t off = 0;
  for (int p = 0; p < world_; p++)
    for (size_t i = 0; i < sc[p]; i++) h[off++] = val(10 * rank_ + p, i);
  upload(ds, h, st_);
  off = 0;
  for (int p = 0; p < world_; p++)
    for (size_t i = 0; i < rc[p]; i++) want[off++] = val(10 * p + rank_, i);
  CHECK(tp_all_to_all(ds, sc, dr, rc, TP_FLOAT32, c, NULL) == TP_SUCCESS, "all_to_all base %zu", base);
  download(h, dr, rt, c);
  CHECK(close_to(h, want, rt), "all_to_all base %zu values", base);
  tp_device_free(TP_DEVICE_CUDA, dev_, ds);
  tp_device_free(TP_DEVICE_CUDA, dev_, dr);
  free(h), free(want);
}

static void test_rooted(tp_comm_t c, size_t n) {
  float *h = malloc((n + 1) * sizeof(float)), *ds = dev_alloc(n), *dr = dev_alloc(n);
  double *want = malloc((n + 1) * sizeof(double));
  int root = world_ - 1;
  for (size_t i = 0; i < n; i++) h[i] = val(rank_, i), want[i] = val(root, i);
  upload(ds, h, n);
  CHECK(tp_broadcast(ds, dr, n, TP_FLOAT32, root, c, NULL) == TP_SUCCESS, "broadcast");
  download(h, dr, n, c);
  CHECK(close_to(h, want, n), "broadcast values");
  for (size_t i = 0; i < n; i++) {
    h[i] = val(rank_, i);
    want[i] = 0;
    for (int r = 0; r < world_; r++) want[i] += val(r, i);
  }
  upload(ds, h, n);
  CHECK(tp_reduce(ds, dr, n, TP_FLOAT32, TP_SUM, root, c, NULL) == TP_SUCCESS, "reduce");
  download(h, dr, n, c);
  if (rank_ == root) CHECK(close_to(h, want, n), "reduce values");
  tp_device_free(TP_DEVICE_CUDA, dev_, ds);
  tp_device_free(TP_DEVICE_CUDA, dev_, dr);
  free(h), free(want);
}

static void test_p2p(tp_comm_t c, size_t n) {
  if (world_ < 2) return;
  float *h = malloc((n + 1) * sizeof(float)), *ds = dev_alloc(n), *dr = dev_alloc(n);
  double *want = malloc((n + 1) * sizeof(double));
  int next = (rank_ + 1) % world_, prev = (rank_ + world_ - 1) % world_;
  for (size_t i = 0; i < n; i++) h[i] = val(rank_, i), want[i] = val(prev, i);
  upload(ds, h, n);
  CHECK(tp_sendrecv(ds, n, next, dr, n, prev, TP_FLOAT32, c, NULL) == TP_SUCCESS, "sendrecv ring");
  download(h, dr, n, c);
  CHECK(close_to(h, want, n), "sendrecv values");
  if (rank_ == 0) CHECK(tp_send(ds, n, TP_FLOAT32, 1, c, NULL) == TP_SUCCESS, "send");
  if (rank_ == 1) {
    CHECK(tp_recv(dr, n, TP_FLOAT32, 0, c, NULL) == TP_SUCCESS, "recv");
    download(h, dr, n, c);
    for (size_t i = 0; i < n; i++) want[i] = val(0, i);
    CHECK(close_to(h, want, n), "recv values");
  }
  CHECK(tp_barrier(c, NULL) == TP_SUCCESS, "barrier");
  tp_device_free(TP_DEVICE_CUDA, dev_, ds);
  tp_device_free(TP_DEVICE_CUDA, dev_, dr);
  free(h), free(want);
}

static void test_split_and_memory(tp_comm_t c) {
  tp_comm_t half = NULL;
  CHECK(tp_comm_split(c, rank_ % 2, rank_, &half) == TP_SUCCESS && half, "split");
  if (half) {
    int n = 0;
    tp_comm_size(half, &n);
    CHECK(n == (world_ - rank_ % 2 + 1) / 2, "split size %d", n);
    float one = 1, got = 0, *d = dev_alloc(1);
    upload(d, &one, 1);
    CHECK(tp_all_reduce(d, d, 1, TP_FLOAT32, TP_SUM, half, NULL) == TP_SUCCESS, "all_reduce on the split");
    download(&got, d, 1, half);
    CHECK(got == (float)n, "split all_reduce %g, want %d", got, n);
    tp_device_free(TP_DEVICE_CUDA, dev_, d);
    tp_comm_destroy(half);
  }
  void *p = NULL;
  tp_mem_t m = NULL;
  tp_status_t st = tp_comm_mem_alloc(c, 1 << 20, &p, &m);
  if (strcmp(backend_, "nccl") == 0) {
    CHECK(st == TP_SUCCESS && p && m, "mem_alloc");
    if (st == TP_SUCCESS) {
      float *h = calloc(1024, sizeof(float));
      double want[1024];
      for (int i = 0; i < 1024; i++) h[i] = val(rank_, (size_t)i), want[i] = 0;
      for (int i = 0; i < 1024; i++)
        for (int r = 0; r < world_; r++) want[i] += val(r, (size_t)i);
      upload(p, h, 1024);
      CHECK(tp_all_reduce(p, p, 1024, TP_FLOAT32, TP_SUM, c, NULL) == TP_SUCCESS, "all_reduce in registered memory");
      download(h, p, 1024, c);
      CHECK(close_to(h, want, 1024), "registered all_reduce values");
      free(h);
    }
  }
  tp_mem_release(m);
}

static void test_mismatch(tp_comm_t c) {
  if (world_ < 2) return;
  float *d = dev_alloc(64);
  tp_comm_set_timeout(c, 10);
  tp_status_t st = tp_all_reduce(d, d, rank_ == 0 ? 16 : 32, TP_FLOAT32, TP_SUM, c, NULL);
  if (st == TP_SUCCESS) st = tp_comm_sync(c, NULL);
  CHECK(st == TP_ERR_MISMATCH && strstr(tp_last_error(), "collective mismatch"), "mismatch status %d", (int)st);
  tp_device_free(TP_DEVICE_CUDA, dev_, d);
}

static int run_rank(int rank) {
  rank_ = rank;
  if (tp_cuda_load(NULL) != TP_SUCCESS || !tp_device_available(TP_DEVICE_CUDA)) {
    fprintf(stderr, "rank %d: no CUDA: %s\n", rank, tp_cuda_status());
    return 3;
  }
  int ndev = tp_device_ops_of(TP_DEVICE_CUDA)->count();
  dev_ = rank % (ndev > 0 ? ndev : 1);
  tp_device_set_current(TP_DEVICE_CUDA, dev_);
  tp_comm_config_t cfg = TP_COMM_CONFIG_INITIALIZER;
  char job[64];
  snprintf(job, sizeof job, "gpu_%s_%d_%d", backend_, world_, (int)getppid());
  cfg.backend = backend_, cfg.job_id = job, cfg.timeout_s = 60, cfg.device_id = dev_;
  tp_comm_t c = NULL;
  if (tp_comm_init_rank(&c, world_, rank, &cfg) != TP_SUCCESS) {
    fprintf(stderr, "rank %d: init: %s\n", rank, tp_last_error());
    return 1;
  }
  size_t sizes[] = {1, 1000, 262147};
  for (int i = 0; i < 3; i++) test_all_reduce(c, sizes[i]);
  test_gather_scatter(c, 1000, 0);
  test_gather_scatter(c, 333, 1);
  test_gather_scatter(c, 0, 1);
  test_all_to_all(c, 0);
  test_all_to_all(c, 70001);
  test_rooted(c, 4099);
  test_p2p(c, 70001);
  test_split_and_memory(c);
  test_mismatch(c);
  tp_comm_destroy(c);
  printf("%s world %d rank %d: %d passed, %d failed\n", backend_, world_, rank, passed, failed);
  return failed ? 1 : 0;
}

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s nccl|shm WORLD\n", argv[0]);
    return 2;
  }
  backend_ = argv[1];
  world_ = atoi(argv[2]);
  if (world_ < 1 || world_ > 64) return 2;
  pid_t pids[64];
  for (int r = 0; r < world_; r++) {
    pids[r] = fork();
    if (pids[r] == 0) {
      int rc = run_rank(r);
      fflush(stdout);
      fflush(stderr);
      _exit(rc);
    }
  }
  int bad = 0;
  for (int r = 0; r < world_; r++) {
    int status = 0;
    waitpid(pids[r], &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) bad++;
  }
  printf("%s world %d: %s\n", backend_, world_, bad ? "FAILED" : "passed");
  return bad ? 1 : 0;
}
