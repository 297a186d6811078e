/*
 * The rendezvous store from C (tpcore/store.h), no Python: operations, 4 client threads
 * (set/get/add/wait/barrier), a get that times out naming its key, a wrong secret, raw
 * hostile sockets (garbage, lengths 2^31 / 2^63 / 0, half a message then silence) while
 * the store keeps serving, a flood of connections that never authenticate while clients come
 * and go, a second server on the same port, no fd left after close, and the collectives over
 * the store that nccl uses across hosts (store_coll.c).
 * Built by `make` (build/test_store) and by tests/distributed/test_store.py under ASan + UBSan.
 */
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "../comm/store/store_impl.h" /* the collectives over the store (nccl's id across hosts) */
#include "tpcore/store.h"

static int passed, failed;
static const char SECRET[] = "0123456789abcdef0123456789abcdef";

#define CHECK(cond)                                                                                              \
  do {                                                                                                           \
    if (!(cond)) {                                                                                               \
      fprintf(stderr, "%s:%d: CHECK failed: %s (last error: %s)\n", __FILE__, __LINE__, #cond, tp_last_error()); \
      return 1;                                                                                                  \
    }                                                                                                            \
  } while (0)

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static tp_store_config_t config(int port, int server, double timeout) {
  tp_store_config_t c = TP_STORE_CONFIG_INITIALIZER;
  c.host = "127.0.0.1", c.port = port, c.is_server = server;
  c.secret = SECRET, c.secret_len = sizeof SECRET - 1;
  c.timeout_s = timeout, c.quiet = 1;
  return c;
}

static int count_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  int n = 0;
  if (!d) return -1;
  while (readdir(d)) n++;
  closedir(d);
  return n;
}

/* A well-behaved client's round trip, from a connection of its own. */
static int round_trip(int port, const char *key) {
  tp_store_config_t c = config(port, 0, 3);
  tp_store_t s;
  if (tp_store_open(&s, &c) != TP_SUCCESS) return 0;
  void *v = NULL;
  size_t n = 0;
  int ok = tp_store_set(s, key, key, strlen(key)) == TP_SUCCESS && tp_store_get(s, key, &v, &n) == TP_SUCCESS &&
           n == strlen(key) && memcmp(v, key, n) == 0;
  tp_store_free(v);
  tp_store_close(s);
  return ok;
}

static int test_operations(void) {
  tp_store_config_t c = config(0, 1, 5);
  tp_store_t s;
  CHECK(tp_store_open(&s, &c) == TP_SUCCESS);
  CHECK(tp_store_port(s) > 0);
  CHECK(tp_store_set(s, "a", "xyz", 3) == TP_SUCCESS);
  void *v;
  size_t n;
  CHECK(tp_store_get(s, "a", &v, &n) == TP_SUCCESS && n == 3 && memcmp(v, "xyz", 3) == 0);
  tp_store_free(v);
  int found = 1;
  CHECK(tp_store_try_get(s, "none", &v, &n, &found) == TP_SUCCESS && !found && v == NULL);
  int64_t r;
  CHECK(tp_store_add(s, "n", 5, &r) == TP_SUCCESS && r == 5);
  CHECK(tp_store_add(s, "n", -7, &r) == TP_SUCCESS && r == -2);
  CHECK(tp_store_add(s, "a", 1, &r) == TP_ERR_REMOTE && strstr(tp_last_error(), "not a decimal integer"));
  CHECK(tp_store_add(s, "n", INT64_MIN, &r) == TP_ERR_REMOTE && strstr(tp_last_error(), "overflows"));
  int existed;
  CHECK(tp_store_delete(s, "a", &existed) == TP_SUCCESS && existed == 1);
  CHECK(tp_store_delete(s, "a", &existed) == TP_SUCCESS && existed == 0);
  const char *keys[] = {"n"};
  CHECK(tp_store_wait(s, keys, 1) == TP_SUCCESS);
  /* bad arguments */
  char big[TP_STORE_MAX_KEY + 2];
  memset(big, 'k', sizeof big - 1);
  big[sizeof big - 1] = 0;
  CHECK(tp_store_set(s, big, "x", 1) == TP_ERR_INVALID_ARGUMENT && strstr(tp_last_error(), "1..512 bytes"));
  CHECK(tp_store_set(s, "", "x", 1) == TP_ERR_INVALID_ARGUMENT);
  CHECK(tp_store_set(s, "k", NULL, 4) == TP_ERR_INVALID_ARGUMENT);
  CHECK(tp_store_set(s, "k", "x", (size_t)TP_STORE_DEFAULT_MAX_VALUE + 1) == TP_ERR_INVALID_ARGUMENT);
  CHECK(tp_store_wait(s, keys, 0) == TP_ERR_INVALID_ARGUMENT);
  CHECK(tp_store_barrier(s, "b", 0) == TP_ERR_INVALID_ARGUMENT);
  CHECK(tp_store_get(NULL, "k", &v, &n) == TP_ERR_INVALID_ARGUMENT);
  tp_store_config_t bad = config(0, 1, 5);
  bad.secret_len = 8;
  tp_store_t t = NULL;
  CHECK(tp_store_open(&t, &bad) == TP_ERR_INVALID_ARGUMENT && t == NULL);
  bad = config(-1, 1, 5);
  CHECK(tp_store_open(&t, &bad) == TP_ERR_INVALID_ARGUMENT);
  CHECK(tp_store_open(&t, NULL) == TP_ERR_INVALID_ARGUMENT);
  tp_store_close(s);
  return 0;
}

typedef struct {
  int port, me, n, ok;
  int64_t ticket;
} worker_t;

static void *worker(void *arg) {
  worker_t *w = arg;
  tp_store_config_t c = config(w->port, 0, 10);
  tp_store_t s;
  if (tp_store_open(&s, &c) != TP_SUCCESS) return NULL;
  char key[32], val[32];
  snprintf(key, sizeof key, "val/%d", w->me);
  snprintf(val, sizeof val, "payload-%d", w->me * 31);
  int ok =
      tp_store_add(s, "tickets", 1, &w->ticket) == TP_SUCCESS && tp_store_set(s, key, val, strlen(val)) == TP_SUCCESS;
  for (int r = 0; ok && r < w->n; r++) {
    void *v = NULL;
    size_t n = 0;
    snprintf(key, sizeof key, "val/%d", r);
    snprintf(val, sizeof val, "payload-%d", r * 31);
    ok = tp_store_get(s, key, &v, &n) == TP_SUCCESS && n == strlen(val) && memcmp(v, val, n) == 0;
    tp_store_free(v);
  }
  for (int round = 0; ok && round < 3; round++) {
    snprintf(key, sizeof key, "sum/%d", round);
    int64_t total = 0;
    ok = tp_store_add(s, key, w->me + 1, NULL) == TP_SUCCESS && tp_store_barrier(s, "step", w->n) == TP_SUCCESS &&
         tp_store_add(s, key, 0, &total) == TP_SUCCESS && total == (int64_t)w->n * (w->n + 1) / 2;
  }
  w->ok = ok;
  tp_store_close(s);
  return NULL;
}

static int test_threads(void) {
  tp_store_config_t c = config(0, 1, 10);
  tp_store_t s;
  CHECK(tp_store_open(&s, &c) == TP_SUCCESS);
  enum { N = 4 };
  pthread_t th[N];
  worker_t w[N];
  for (int i = 0; i < N; i++) {
    w[i] = (worker_t){.port = tp_store_port(s), .me = i, .n = N};
    CHECK(pthread_create(&th[i], NULL, worker, &w[i]) == 0);
  }
  int seen = 0;
  for (int i = 0; i < N; i++) {
    pthread_join(th[i], NULL);
    CHECK(w[i].ok);
    CHECK(w[i].ticket >= 1 && w[i].ticket <= N);
    seen |= 1 << (w[i].ticket - 1);
  }
  CHECK(seen == (1 << N) - 1);
  tp_store_close(s);
  return 0;
}

static int test_timeout_and_secret(void) {
  tp_store_config_t c = config(0, 1, 0.4);
  tp_store_t s;
  CHECK(tp_store_open(&s, &c) == TP_SUCCESS);
  void *v = NULL;
  size_t n;
  double t0 = now();
  CHECK(tp_store_get(s, "never/here", &v, &n) == TP_ERR_TIMEOUT);
  CHECK(now() - t0 >= 0.35 && now() - t0 < 3);
  CHECK(strstr(tp_last_error(), "never/here") && strstr(tp_last_error(), "0.4 s"));
  CHECK(tp_store_barrier(s, "pair", 2) == TP_ERR_TIMEOUT && strstr(tp_last_error(), "1 of 2 arrived"));
  tp_store_config_t w = config(tp_store_port(s), 0, 2);
  w.secret = "another secret, 24 bytes", w.secret_len = 24;
  tp_store_t t = NULL;
  CHECK(tp_store_open(&t, &w) == TP_ERR_INVALID_USAGE && strstr(tp_last_error(), "authentication failed"));
  tp_store_config_t again = config(tp_store_port(s), 1, 2);
  CHECK(tp_store_open(&t, &again) == TP_ERR_SYSTEM && strstr(tp_last_error(), "already in use"));
  CHECK(round_trip(tp_store_port(s), "after"));
  tp_store_close(s);
  return 0;
}

static int raw_connect(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0) return -1;
  return fd;
}

/* Seconds until the server closes fd (reading and dropping what it sends); -1 past limit. */
static double closed_after(int fd, double limit) {
  double t0 = now();
  char buf[4096];
  while (now() - t0 < limit) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, 100) <= 0) continue;
    ssize_t r = recv(fd, buf, sizeof buf, 0);
    if (r <= 0) return now() - t0;
  }
  return -1;
}

static int test_hostile(void) {
  tp_store_config_t c = config(0, 1, 5);
  c.io_timeout_s = 1.0;
  tp_store_t s;
  CHECK(tp_store_open(&s, &c) == TP_SUCCESS);
  int port = tp_store_port(s);
  static const uint64_t lens[] = {(uint64_t)1 << 31, (uint64_t)1 << 63, 0, UINT64_MAX};
  for (int i = 0; i < 4; i++) {
    int fd = raw_connect(port);
    CHECK(fd >= 0);
    uint8_t m[8];
    for (int b = 0; b < 8; b++) m[b] = (uint8_t)(lens[i] >> (8 * b));
    CHECK(send(fd, m, 8, 0) == 8);
    double t = closed_after(fd, 3);
    CHECK(t >= 0 && t < 0.9); /* refused at once, not at the deadline */
    close(fd);
    CHECK(round_trip(port, "between"));
  }
  int garbage = raw_connect(port);
  CHECK(garbage >= 0 && send(garbage, "GET / HTTP/1.0\r\n\r\n", 18, 0) == 18);
  CHECK(closed_after(garbage, 3) >= 0);
  close(garbage);
  int slow = raw_connect(port);
  uint8_t half[12] = {65, 0, 0, 0, 0, 0, 0, 0, 1, 'z', 'z', 'z'};
  CHECK(slow >= 0 && send(slow, half, sizeof half, 0) == (ssize_t)sizeof half);
  double t0 = now();
  CHECK(round_trip(port, "during"));
  CHECK(now() - t0 < 0.5);
  double t = closed_after(slow, 3);
  CHECK(t > 0.5 && t < 2.5);
  close(slow);
  CHECK(round_trip(port, "after"));
  tp_store_close(s);
  return 0;
}

/* ---- a flood: threads open connections as fast as they can and never authenticate */

typedef struct {
  int port;
  double until;
  _Atomic int opened, clients, failures;
} flood_t;

static void *flooder(void *arg) {
  flood_t *f = arg;
  enum { HOLD = 100 }; /* more than the server's slots for unauthenticated connections (32 here) */
  int held[HOLD], next = 0;
  for (int i = 0; i < HOLD; i++) held[i] = -1;
  while (now() < f->until) {
    int fd = raw_connect(f->port);
    if (fd < 0) continue;
    f->opened++;
    if (held[next] >= 0) close(held[next]);
    held[next] = fd, next = (next + 1) % HOLD;
  }
  for (int i = 0; i < HOLD; i++)
    if (held[i] >= 0) close(held[i]);
  return NULL;
}

static void *flood_client(void *arg) {
  flood_t *f = arg;
  char key[64];
  while (now() < f->until) {
    snprintf(key, sizeof key, "flood/%d", atomic_fetch_add(&f->clients, 1));
    tp_store_config_t c = config(f->port, 0, 30);
    tp_store_t s;
    void *v = NULL;
    size_t n = 0;
    int ok = tp_store_open(&s, &c) == TP_SUCCESS;
    if (ok) {
      ok = tp_store_set(s, key, key, strlen(key)) == TP_SUCCESS && tp_store_get(s, key, &v, &n) == TP_SUCCESS &&
           n == strlen(key) && memcmp(v, key, n) == 0;
      tp_store_free(v);
      tp_store_close(s);
    }
    if (!ok) fprintf(stderr, "flood: a client failed: %s\n", tp_last_error());
    f->failures += !ok;
  }
  return NULL;
}

static int test_flood(void) {
  tp_store_config_t c = config(0, 1, 30);
  c.max_clients = 64; /* 32 slots for connections that have not authenticated */
  c.quiet = 0;        /* the rate-limited log: a few lines */
  tp_store_t s;
  CHECK(tp_store_open(&s, &c) == TP_SUCCESS);
  flood_t f = {.port = tp_store_port(s), .until = now() + 1.5};
  pthread_t th[5];
  for (int i = 0; i < 5; i++) CHECK(pthread_create(&th[i], NULL, i < 2 ? flooder : flood_client, &f) == 0);
  for (int i = 0; i < 5; i++) pthread_join(th[i], NULL);
  printf("flood: %d connections that never authenticated, %d clients, %d failed\n", f.opened, f.clients, f.failures);
  CHECK(f.failures == 0 && f.clients > 0 && f.opened > 64);
  CHECK(round_trip(f.port, "after"));
  tp_store_close(s);
  return 0;
}

static void *blocked_get(void *arg) {
  tp_store_t s = arg;
  void *v = NULL;
  size_t n;
  tp_status_t st = tp_store_get(s, "never", &v, &n);
  return (void *)(intptr_t)(st == TP_ERR_ABORTED && strstr(tp_last_error(), "closed"));
}

static int test_interrupt(void) {
  tp_store_config_t c = config(0, 1, 30);
  tp_store_t s, t;
  CHECK(tp_store_open(&s, &c) == TP_SUCCESS);
  tp_store_config_t k = config(tp_store_port(s), 0, 30);
  CHECK(tp_store_open(&t, &k) == TP_SUCCESS);
  pthread_t th;
  CHECK(pthread_create(&th, NULL, blocked_get, t) == 0);
  usleep(200000);
  double t0 = now();
  tp_store_interrupt(t);
  void *ok;
  pthread_join(th, &ok);
  CHECK(ok && now() - t0 < 2);
  CHECK(tp_store_set(t, "k", "v", 1) == TP_ERR_ABORTED);
  tp_store_close(t);
  CHECK(round_trip(tp_store_port(s), "after"));
  tp_store_close(s);
  return 0;
}

static int test_no_fd_leak(void) {
  int before = count_fds();
  for (int i = 0; i < 3; i++) {
    tp_store_config_t c = config(0, 1, 5);
    tp_store_t s;
    CHECK(tp_store_open(&s, &c) == TP_SUCCESS);
    CHECK(round_trip(tp_store_port(s), "x"));
    int fd = raw_connect(tp_store_port(s)); /* still open when the server closes */
    tp_store_close(s);
    if (fd >= 0) close(fd);
  }
  CHECK(count_fds() == before);
  return 0;
}

/* ---- collectives over the store: what nccl's init and split do when the ranks span hosts */

#define NR 4
typedef struct {
  int me, ok;
  unsigned char id[128];
  int nrank, nsize;
} coll_t;

/* A stand-in for ncclGetUniqueId: 128 recognizable bytes, different per call. */
static void fake_unique_id(unsigned char *id) {
  static int calls;
  for (int i = 0; i < 128; i++) id[i] = (unsigned char)(0xA5 ^ (i * 7) ^ (calls * 13));
  calls++;
}

static void *coll_worker(void *arg) {
  coll_t *w = arg;
  tp_store_t s;
  if (tp_job_store_open(&s, 10, "test") != TP_SUCCESS) return NULL;
  if (w->me == 0) fake_unique_id(w->id);
  int ok = tp_store_bcast(s, "tpcore/nccl/job/world/id", w->me, 0, w->id, sizeof w->id) == TP_SUCCESS;
  /* colors: even / odd ranks, rank 3 out (NOCOLOR); keys reverse the order */
  int color = w->me == 3 ? -1 : w->me % 2;
  ok = ok && tp_store_split_ranks(s, "tpcore/nccl/job/world/split0", w->me, NR, color, -w->me, &w->nrank, &w->nsize) ==
                 TP_SUCCESS;
  w->ok = ok;
  tp_store_close(s);
  return NULL;
}

static int test_store_collectives(void) {
  tp_store_config_t c = config(0, 1, 10);
  tp_store_t s;
  CHECK(tp_store_open(&s, &c) == TP_SUCCESS);
  char port[16];
  snprintf(port, sizeof port, "%d", tp_store_port(s));
  unsetenv("MASTER_ADDR");
  tp_store_t t = NULL;
  CHECK(tp_job_store_open(&t, 1, "who") == TP_ERR_INVALID_USAGE && strstr(tp_last_error(), "MASTER_ADDR is not set"));
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", "99999", 1);
  setenv("TPCORE_STORE_SECRET", SECRET, 1);
  CHECK(tp_job_store_open(&t, 1, "who") == TP_ERR_INVALID_ARGUMENT && strstr(tp_last_error(), "MASTER_PORT"));
  setenv("MASTER_PORT", port, 1);
  pthread_t th[NR];
  coll_t w[NR];
  memset(w, 0, sizeof w);
  for (int i = 0; i < NR; i++) {
    w[i].me = i;
    CHECK(pthread_create(&th[i], NULL, coll_worker, &w[i]) == 0);
  }
  for (int i = 0; i < NR; i++) pthread_join(th[i], NULL);
  unsigned char want[128];
  for (int i = 0; i < 128; i++) want[i] = (unsigned char)(0xA5 ^ (i * 7));
  for (int i = 0; i < NR; i++) {
    CHECK(w[i].ok);
    CHECK(memcmp(w[i].id, want, sizeof want) == 0); /* every rank holds rank 0's id */
  }
  /* even: ranks 0, 2 with keys 0, -2 -> rank 2 first; odd: rank 1 alone; rank 3: none */
  CHECK(w[0].nrank == 1 && w[0].nsize == 2 && w[2].nrank == 0 && w[2].nsize == 2);
  CHECK(w[1].nrank == 0 && w[1].nsize == 1 && w[3].nrank == -1 && w[3].nsize == 0);
  /* a root that never publishes: the wait names the rank, the root and the key */
  tp_store_config_t q = config(tp_store_port(s), 0, 0.3);
  CHECK(tp_store_open(&t, &q) == TP_SUCCESS);
  unsigned char id[128];
  CHECK(tp_store_bcast(t, "tpcore/nccl/job/other/id", 2, 0, id, sizeof id) == TP_ERR_TIMEOUT);
  CHECK(strstr(tp_last_error(), "rank 2 waiting for rank 0's 'tpcore/nccl/job/other/id'"));
  /* a blob of another size (another version's struct): a mismatch, not garbage */
  CHECK(tp_store_bcast(t, "tpcore/nccl/job/world/id", 1, 0, id, 64) == TP_ERR_MISMATCH);
  CHECK(strstr(tp_last_error(), "published 128 bytes"));
  tp_store_close(t);
  tp_store_close(s);
  return 0;
}

int main(void) {
  struct {
    const char *name;
    int (*fn)(void);
  } tests[] = {{"operations", test_operations},
               {"threads", test_threads},
               {"timeout_and_secret", test_timeout_and_secret},
               {"hostile", test_hostile},
               {"no_fd_leak", test_no_fd_leak},
               {"store_collectives", test_store_collectives},
               {"interrupt", test_interrupt},
               {"flood", test_flood}};
  for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++) {
    int bad = tests[i].fn();
    printf("%s %s\n", bad ? "FAIL" : "ok  ", tests[i].name);
    if (bad) failed++;
    else passed++;
  }
  printf("%d passed, %d failed\n", passed, failed);
  return failed != 0;
}
