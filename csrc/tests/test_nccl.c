/*
 * The NCCL binding's error paths, without a GPU or NCCL: no library (the override,
 * and the search order without it), a library too old, one lacking a symbol, and a
 * good one on a machine without a CUDA device.  The fakes (fake_nccl.c) are built by
 * the Makefile into $TPCORE_TEST_FAKE_NCCL/{old,nosym,good}/libnccl.so.2.
 *
 * The binding keeps a library that loaded and passed its checks for the life of the
 * process: the good fake comes last.  Also: what a timeout says of the ranks, from slots
 * filled here (the descriptor segment a real communicator shares).
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../comm/nccl/nccl_impl.h" /* tp_nccl_laggards and the slots it reads */
#include "tpcore/comm.h"
#include "tpcore/device.h"

static int failures;

static void expect(const char *what, tp_status_t st, tp_status_t want, const char *const *needles) {
  const char *msg = tp_last_error();
  int ok = st == want;
  for (int i = 0; ok && needles[i]; i++) ok = strstr(msg, needles[i]) != NULL;
  if (!ok) {
    failures++;
    fprintf(stderr, "FAIL %s: status %d (want %d): %s\n", what, (int)st, (int)want, msg);
  }
}

/* Both entries: the probe and an init of one rank (which must fail the same way, leaving nothing). */
static void both(const char *what, const char *const *needles) {
  expect(what, tp_comm_backend_usable("nccl"), TP_ERR_UNSUPPORTED, needles);
  tp_comm_config_t cfg = TP_COMM_CONFIG_INITIALIZER;
  cfg.backend = "nccl";
  cfg.job_id = "test_nccl_errors";
  cfg.timeout_s = 5;
  tp_comm_t c = (tp_comm_t)0x1;
  expect(what, tp_comm_init_rank(&c, 1, 0, &cfg), TP_ERR_UNSUPPORTED, needles);
  if (c) {
    failures++;
    fprintf(stderr, "FAIL %s: a failed init left a communicator\n", what);
  }
}

/* The dispatcher's new entries on the shm backend: sync has nothing to wait for, the probe,
 * a config of the size before device_id existed. */
static void dispatcher(void) {
  expect("sync NULL", tp_comm_sync(NULL, NULL), TP_ERR_INVALID_ARGUMENT, (const char *[]){"comm_sync", NULL});
  expect("probe NULL", tp_comm_backend_usable(NULL), TP_ERR_UNSUPPORTED,
         (const char *[]){"not available in this build", "shm, nccl", NULL});
  if (tp_comm_backend_usable("shm") != TP_SUCCESS) {
    failures++;
    fprintf(stderr, "FAIL probe shm: %s\n", tp_last_error());
  }
  tp_comm_config_t cfg = TP_COMM_CONFIG_INITIALIZER;
  cfg.size = offsetof(tp_comm_config_t, device_id); /* built against the previous header */
  cfg.job_id = "test_nccl_dispatch";
  cfg.timeout_s = 5;
  tp_comm_t c = NULL;
  tp_status_t st = tp_comm_init_rank(&c, 1, 0, &cfg);
  const char *name = NULL;
  if (st != TP_SUCCESS || tp_comm_backend(c, &name) != TP_SUCCESS || strcmp(name, "shm") != 0) {
    failures++;
    fprintf(stderr, "FAIL shm init with an older config: %s\n", tp_last_error());
  } else {
    float x[4] = {1, 2, 3, 4};
    if (tp_all_reduce(x, x, 4, TP_FLOAT32, TP_SUM, c, NULL) != TP_SUCCESS || tp_comm_sync(c, NULL) != TP_SUCCESS ||
        x[3] != 4) {
      failures++;
      fprintf(stderr, "FAIL shm all_reduce + sync: %s\n", tp_last_error());
    }
  }
  tp_comm_destroy(c);
}

/* nccl.c: whether the ranks meet through the job's store (several hosts) or shared memory. */
int tp_nccl_bootstrap_store(int size, int world_comm);

static void bootstrap_choice(void) {
  struct {
    const char *nnodes, *lws, *how;
    int size, world, want;
  } cases[] = {
      {NULL, NULL, NULL, 4, 1, 0}, {NULL, "4", NULL, 4, 1, 0},     {NULL, "2", NULL, 4, 1, 1},
      {NULL, "2", NULL, 2, 0, 0},  {"2", "2", NULL, 2, 0, 1},      {"1", "4", NULL, 4, 1, 0},
      {NULL, "2", "shm", 4, 1, 0}, {NULL, NULL, "store", 1, 1, 1},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    if (cases[i].nnodes) setenv("TPCORE_NNODES", cases[i].nnodes, 1);
    else unsetenv("TPCORE_NNODES");
    if (cases[i].lws) setenv("LOCAL_WORLD_SIZE", cases[i].lws, 1);
    else unsetenv("LOCAL_WORLD_SIZE");
    if (cases[i].how) setenv("TPCORE_NCCL_BOOTSTRAP", cases[i].how, 1);
    else unsetenv("TPCORE_NCCL_BOOTSTRAP");
    int got = tp_nccl_bootstrap_store(cases[i].size, cases[i].world);
    if (got != cases[i].want) {
      failures++;
      fprintf(stderr, "FAIL bootstrap case %zu: got %d, want %d\n", i, got, cases[i].want);
    }
  }
  unsetenv("TPCORE_NNODES");
  unsetenv("LOCAL_WORLD_SIZE");
  unsetenv("TPCORE_NCCL_BOOTSTRAP");
}

/* A timed-out wait for collective #62 names the ranks behind it and their last calls. */
static void laggards(void) {
  enum { N = 5 };
  struct tp_comm comm;
  memset(&comm, 0, sizeof comm);
  comm.rank = 1, comm.size = N;
  nccl_slot_t *slots = calloc(N, sizeof *slots);
  nccl_ctx x;
  memset(&x, 0, sizeof x);
  x.comm = &comm, x.slots = slots, x.seq = 62;
  /* rank 0 and 3 were last in all_reduce #61, rank 2 has posted #62, rank 4 is in #60 (its #61 not posted) */
  uint32_t last[N] = {61, 62, 62, 61, 60},
           kinds[N] = {TP_COLL_ALL_REDUCE, TP_COLL_BARRIER, TP_COLL_BARRIER, TP_COLL_ALL_REDUCE, TP_COLL_BROADCAST};
  for (int p = 0; p < N; p++) {
    atomic_store(&slots[p].state, NCCL_STATE_READY);
    atomic_store(&slots[p].last_seq, last[p]);
    slots[p].ring[last[p] % NCCL_RING].kind = kinds[p];
    atomic_store(&slots[p].ring[last[p] % NCCL_RING].seq, last[p]);
  }
  char buf[512];
  struct {
    const char *want;
  } cases[3] = {{": ranks 0, 3 did not arrive (their last call: all_reduce #61); rank 4 did not arrive (its last call: "
                 "broadcast #60)"},
                {": ranks 0, 3 did not arrive (their last call: all_reduce #61); rank 4 has not finished init"},
                {" (the ranks span hosts: which of them did not arrive is not known here)"}};
  for (int c = 0; c < 3; c++) {
    if (c == 1) atomic_store(&slots[4].state, NCCL_STATE_INIT);
    if (c == 2) x.slots = NULL;
    tp_nccl_laggards(&x, buf, sizeof buf);
    if (strcmp(buf, cases[c].want)) {
      failures++;
      fprintf(stderr, "FAIL laggards case %d: '%s', want '%s'\n", c, buf, cases[c].want);
    }
  }
  x.slots = slots; /* every peer has posted #62: nothing to name */
  for (int p = 0; p < N; p++) atomic_store(&slots[p].last_seq, 62);
  atomic_store(&slots[4].state, NCCL_STATE_READY);
  tp_nccl_laggards(&x, buf, sizeof buf);
  if (buf[0]) {
    failures++;
    fprintf(stderr, "FAIL laggards with every peer there: '%s'\n", buf);
  }
  tp_nccl_laggards(&x, buf, 8); /* a short buffer: truncated, terminated */
  free(slots);
}

int main(void) {
  dispatcher();
  bootstrap_choice();
  laggards();
  const char *dir = getenv("TPCORE_TEST_FAKE_NCCL");
  if (!dir) {
    fprintf(stderr, "TPCORE_TEST_FAKE_NCCL is not set (make test sets it)\n");
    return 2;
  }
  char path[4096];

  setenv("TPCORE_NCCL_LIBRARY", "/nonexistent/libnccl.so.2", 1);
  both("override missing", (const char *[]){"backend nccl", "TPCORE_NCCL_LIBRARY=/nonexistent/libnccl.so.2", NULL});

  unsetenv("TPCORE_NCCL_LIBRARY");
  setenv("CUDA_HOME", "/nonexistent-cuda-home", 1);
  unsetenv("CUDA_PATH");
  both("search order", (const char *[]){"cannot find NCCL", "TPCORE_NCCL_LIBRARY (unset)",
                                        "/nonexistent-cuda-home/lib64/libnccl.so.2", "libnccl.so", NULL});
  const char *m = tp_last_error(); /* CUDA_HOME before the loader path */
  const char *home = strstr(m, "/nonexistent-cuda-home"), *plain = strstr(m, ", libnccl.so.2");
  if (!home || !plain || home > plain) {
    failures++;
    fprintf(stderr, "FAIL search order: %s\n", m);
  }

  snprintf(path, sizeof path, "%s/old/libnccl.so.2", dir);
  setenv("TPCORE_NCCL_LIBRARY", path, 1);
  both("too old", (const char *[]){"too old", path, "2.16.3", "2.19.0", NULL});

  snprintf(path, sizeof path, "%s/nosym/libnccl.so.2", dir);
  setenv("TPCORE_NCCL_LIBRARY", path, 1);
  both("lacking a symbol", (const char *[]){"has no symbol ncclCommSplit", path, NULL});

  /* Found through CUDA_HOME: the search order reaches a directory. */
  unsetenv("TPCORE_NCCL_LIBRARY");
  snprintf(path, sizeof path, "%s/home", dir);
  setenv("CUDA_HOME", path, 1);
  both("too old, through CUDA_HOME", (const char *[]){"too old", "/home/lib64/libnccl.so.2", NULL});

  snprintf(path, sizeof path, "%s/good/libnccl.so.2", dir);
  setenv("TPCORE_NCCL_LIBRARY", path, 1);
  if (!tp_device_available(TP_DEVICE_CUDA))
    both("no CUDA device", (const char *[]){"backend nccl", "no CUDA device", NULL});

  if (failures) {
    fprintf(stderr, "%d failed\n", failures);
    return 1;
  }
  printf("nccl error paths: passed\n");
  return 0;
}
