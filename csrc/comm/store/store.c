/*
 * The rendezvous store (tpcore/store.h): its client and the public tp_store_* API.  The
 * server, a TCP key-value server in a thread of the process that opens the store with
 * is_server, is store_server.c; the wire format and what the files share, store_proto.h;
 * SHA-256 and HMAC, store_hmac.c.
 */
#include <errno.h>
#include <inttypes.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "store_proto.h"

/* ------------------------------------------------------------ the client */

struct tp_store {
  pthread_mutex_t lock;    /* one call at a time */
  pthread_mutex_t fd_lock; /* fd's changes against tp_store_interrupt from another thread */
  atomic_int interrupted;
  int fd;
  int peer_closed;   /* the last io_all failed because the server closed the connection */
  int connect_errno; /* the last connect's error, 0 when it connected */
  char where[300];   /* "store at host:port" */
  struct sockaddr_storage addr;
  socklen_t addrlen;
  uint8_t secret[TP_STORE_MAX_SECRET];
  size_t secret_len;
  double timeout;
  size_t max_value;
  server_t *server;
  int port;
};

/* A poll() wait of at most one second toward a deadline `left` seconds away (no int overflow). */
static int poll_ms(double left) { return left >= 1.0 ? 1000 : left > 0 ? (int)(left * 1000.0) + 1 : 0; }

static void drop_conn(tp_store_t s) {
  pthread_mutex_lock(&s->fd_lock);
  if (s->fd >= 0) close(s->fd);
  s->fd = -1;
  pthread_mutex_unlock(&s->fd_lock);
}

static tp_status_t interrupted_error(tp_store_t s) {
  return tp_set_error(TP_ERR_ABORTED, "%s: the store was closed (by another thread) during or before this call",
                      s->where);
}

/* Writes or reads all n bytes before the deadline.  0 on success; else the status (the
 * connection is dropped), with the sentence naming `what`. */
static tp_status_t io_all(tp_store_t s, int writing, void *buf, size_t n, double deadline, const char *what) {
  uint8_t *p = buf;
  while (n) {
    double left = deadline - tp_now();
    if (left <= 0) {
      drop_conn(s);
      return tp_set_error(TP_ERR_TIMEOUT, "%s: %s: timed out after %g s", s->where, what, s->timeout);
    }
    struct pollfd pf = {.fd = s->fd, .events = writing ? POLLOUT : POLLIN};
    int r = poll(&pf, 1, poll_ms(left));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) continue;
    ssize_t k = writing ? send(s->fd, p, n, MSG_NOSIGNAL) : recv(s->fd, p, n, 0);
    if (k > 0) {
      p += k, n -= (size_t)k;
      continue;
    }
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
    int e = k == 0 ? 0 : errno;
    drop_conn(s);
    if (atomic_load(&s->interrupted)) return interrupted_error(s);
    s->peer_closed = 1;
    return tp_set_error(TP_ERR_REMOTE,
                        "%s: %s: the store closed the connection%s%s (its host process exited, or "
                        "it refused this client: see its log)",
                        s->where, what, e ? ": " : "", e ? strerror(e) : "");
  }
  return TP_SUCCESS;
}

/* Reads one reply: *status and a malloc'd payload (NUL-terminated past *n). */
static tp_status_t read_reply(tp_store_t s, double deadline, const char *what, int *status, uint8_t **payload,
                              size_t *n) {
  uint8_t hdr[8];
  TP_CHECK(io_all(s, 0, hdr, 8, deadline, what));
  uint64_t len = get_u64(hdr);
  size_t cap;
  if (!tp_add_size(s->max_value, 1 + MAX_ERR_TEXT, &cap) || len == 0 || len > cap) {
    drop_conn(s);
    return tp_set_error(TP_ERR_REMOTE,
                        "%s: %s: the server sent a reply of %" PRIu64
                        " bytes (the most is %zu: "
                        "not a tpcore store, or a larger max_value_bytes there)",
                        s->where, what, len, cap);
  }
  uint8_t *b = malloc((size_t)len + 1);
  if (!b) {
    drop_conn(s);
    return tp_set_error(TP_ERR_NOMEM, "%s: %s: out of memory for a reply of %" PRIu64 " bytes", s->where, what, len);
  }
  tp_status_t st = io_all(s, 0, b, (size_t)len, deadline, what);
  if (st != TP_SUCCESS) {
    free(b);
    return st;
  }
  b[len] = 0;
  *status = b[0];
  *n = (size_t)len - 1;
  memmove(b, b + 1, (size_t)len); /* payload first, keeps the terminator */
  *payload = b;
  return TP_SUCCESS;
}

/* How one try to connect and authenticate failed: worth another try or not. */
enum { TRY_FATAL, TRY_REFUSED, TRY_CLOSED };

/* A try the server closed (its error says where in the handshake), or the error as it is. */
static tp_status_t try_failed(tp_store_t s, tp_status_t st, int *kind, const char *when) {
  if (!s->peer_closed) return st;
  *kind = TRY_CLOSED;
  return tp_set_error(TP_ERR_REMOTE, "%s: the store closed the connection %s", s->where, when);
}

static tp_status_t connect_once(tp_store_t s, double deadline, int *kind) {
  *kind = TRY_FATAL;
  s->peer_closed = 0;
  int fd = socket(s->addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return tp_set_error(TP_ERR_SYSTEM, "%s: socket: %s", s->where, strerror(errno));
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  int e = 0;
  if (connect(fd, (struct sockaddr *)&s->addr, s->addrlen) != 0) {
    e = errno;
    if (e == EINPROGRESS) { /* polled at least once, so an answer already there is seen */
      struct pollfd pf = {.fd = fd, .events = POLLOUT};
      int r;
      for (double left;;) {
        left = deadline - tp_now();
        r = poll(&pf, 1, poll_ms(left));
        if (r < 0 && errno == EINTR) continue;
        if (r != 0 || left <= 0 || atomic_load(&s->interrupted)) break;
      }
      socklen_t el = sizeof e;
      if (r > 0) getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &el);
      else e = ETIMEDOUT;
    }
  }
  s->connect_errno = e;
  if (e != 0) {
    close(fd);
    *kind = TRY_REFUSED;
    return tp_set_error(TP_ERR_TIMEOUT,
                        "%s: cannot connect within %g s: %s (is the store's host up and "
                        "MASTER_ADDR / MASTER_PORT right?)",
                        s->where, s->timeout, strerror(e));
  }
  pthread_mutex_lock(&s->fd_lock);
  s->fd = fd;
  pthread_mutex_unlock(&s->fd_lock);
  if (atomic_load(&s->interrupted)) {
    drop_conn(s);
    return interrupted_error(s);
  }
  uint8_t g[GREETING];
  tp_status_t st = io_all(s, 0, g, GREETING, deadline, "waiting for the server's greeting");
  if (st != TP_SUCCESS) return try_failed(s, st, kind, "before its greeting");
  if (memcmp(g, "TPCS", 4) != 0 || g[4] != STORE_VERSION) {
    drop_conn(s);
    return tp_set_error(TP_ERR_REMOTE, "%s: the server there is not a tpcore store of protocol version %u", s->where,
                        STORE_VERSION);
  }
  uint8_t hello[8 + HELLO_BODY];
  put_u64(hello, HELLO_BODY);
  hello[8] = OP_HELLO;
  if (!tp_store_random_bytes(hello + 9, NONCE)) {
    drop_conn(s);
    return tp_set_error(TP_ERR_SYSTEM, "%s: getrandom: %s", s->where, strerror(errno));
  }
  tp_store_hmac3(s->secret, s->secret_len, "tpcore-store-v1 client", g + 8, hello + 9, hello + 9 + NONCE);
  int status = ST_ERR;
  uint8_t *p = NULL;
  size_t n = 0;
  st = io_all(s, 1, hello, sizeof hello, deadline, "authenticating");
  if (st == TP_SUCCESS) st = read_reply(s, deadline, "authenticating", &status, &p, &n);
  if (st != TP_SUCCESS) return try_failed(s, st, kind, "after the greeting, before authentication");
  uint8_t want[MAC];
  tp_store_hmac3(s->secret, s->secret_len, "tpcore-store-v1 server", hello + 9, g + 8, want);
  if (status == ST_ERR) st = tp_set_error(TP_ERR_INVALID_USAGE, "%s refused this client: %s", s->where, (char *)p);
  else if (status != ST_OK || n != MAC || !tp_store_same_mac(want, p))
    st = tp_set_error(TP_ERR_INVALID_USAGE,
                      "%s: the server does not know this job's secret (a different job's store "
                      "on this port, or TPCORE_STORE_SECRET differs between nodes)",
                      s->where);
  free(p);
  if (st != TP_SUCCESS) drop_conn(s);
  return st;
}

/* Sleeps about `pause` seconds (half of it plus a random part of the other half: clients that
 * failed together do not come back together), waking for tp_store_interrupt. */
static void backoff_sleep(tp_store_t s, double pause) {
  uint16_t r = 0;
  if (!tp_store_random_bytes((uint8_t *)&r, sizeof r)) r = 32768;
  double until = tp_now() + pause * (0.5 + 0.5 * r / 65536.0);
  for (double left; !atomic_load(&s->interrupted) && (left = until - tp_now()) > 0;)
    usleep(left > 0.01 ? 10000 : (useconds_t)(left * 1e6) + 1);
}

/* The error of a connection given up on after `tries`, `closed` of which the server closed
 * before authentication; the last try's error (st, tp_last_error) when none was closed. */
static tp_status_t gave_up(tp_store_t s, tp_status_t st, int tries, int closed, int last_refused, double took) {
  if (closed == 0) return st;
  char then[160] = "";
  if (last_refused && s->connect_errno == ECONNREFUSED)
    snprintf(then, sizeof then, "; then it refused connections: its process has exited?");
  else if (last_refused)
    snprintf(then, sizeof then, "; then connecting failed (%s): its host is down or unreachable?",
             strerror(s->connect_errno));
  char last[768];
  const char *m = tp_last_error();
  size_t w = strlen(s->where);
  snprintf(last, sizeof last, "%s", strncmp(m, s->where, w) == 0 && m[w] == ':' ? m + w + 2 : m);
  return tp_set_error(TP_ERR_TIMEOUT,
                      "%s kept closing the connection before authentication (%d of %d tries in %.1f s closed, "
                      "timeout %g s): it drops connections that have not authenticated when too many are open at "
                      "once, so it is likely flooded by connections that do not authenticate (its log counts them)%s "
                      "(the last try: %s)",
                      s->where, closed, tries, took, s->timeout, then, last);
}

/* Connects (again) when needed.  A refused connection (the server is not up yet) and one the
 * server closes before authentication (it drops unauthenticated connections when too many
 * are open at once) are tried again until the deadline, after pauses that double from 10 ms
 * to 0.5 s, with jitter; a wrong secret or a timeout is not. */
static tp_status_t ensure_conn(tp_store_t s, double deadline) {
  if (s->fd >= 0) return TP_SUCCESS;
  double t0 = tp_now(), pause = 0.01;
  int tries = 0, closed = 0;
  for (;;) {
    if (atomic_load(&s->interrupted)) return interrupted_error(s);
    int kind;
    tp_status_t st = connect_once(s, deadline, &kind);
    tries++;
    closed += kind == TRY_CLOSED;
    if (st == TP_SUCCESS || (kind == TRY_FATAL && st != TP_ERR_TIMEOUT)) return st; /* done, or refused for good */
    double left = deadline - tp_now();
    if (kind == TRY_FATAL || left <= 0.001) return gave_up(s, st, tries, closed, kind == TRY_REFUSED, tp_now() - t0);
    backoff_sleep(s, pause < left / 2 ? pause : left / 2); /* time left for one more try */
    pause = pause * 2 < 0.5 ? pause * 2 : 0.5;
  }
}

/* One request and its reply under the timeout. */
static tp_status_t request(tp_store_t s, const uint8_t *body, size_t n, const char *what, int *status,
                           uint8_t **payload, size_t *pn) {
  if (atomic_load(&s->interrupted)) return interrupted_error(s);
  double deadline = tp_now() + s->timeout;
  TP_CHECK(ensure_conn(s, deadline));
  uint8_t hdr[8];
  put_u64(hdr, n);
  TP_CHECK(io_all(s, 1, hdr, 8, deadline, what));
  TP_CHECK(io_all(s, 1, (void *)body, n, deadline, what));
  TP_CHECK(read_reply(s, deadline, what, status, payload, pn));
  if (*status == ST_ERR) {
    tp_status_t st = tp_set_error(TP_ERR_REMOTE, "%s: %s: %s", s->where, what, (char *)*payload);
    free(*payload);
    *payload = NULL;
    return st;
  }
  return TP_SUCCESS;
}

static tp_status_t check_key(tp_store_t s, const char *op, const char *key, size_t *klen) {
  if (!s) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "store %s: the store is NULL", op);
  if (!key) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "store %s: key is NULL", op);
  size_t n = strnlen(key, TP_STORE_MAX_KEY + 1);
  if (n == 0 || n > TP_STORE_MAX_KEY)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "store %s: a key must have 1..%d bytes, got %s", op, TP_STORE_MAX_KEY,
                        n ? "more" : "an empty key");
  *klen = n;
  return TP_SUCCESS;
}

/* op [prefix bytes] u16 klen key [suffix]: a malloc'd body. */
static uint8_t *key_body(int op, const uint8_t *pre, size_t npre, const char *key, size_t klen, const void *suf,
                         size_t nsuf, size_t *n) {
  size_t total;
  if (!tp_add_size(1 + 2 + npre + klen, nsuf, &total)) return NULL;
  uint8_t *b = malloc(total);
  if (!b) return NULL;
  b[0] = (uint8_t)op;
  TP_COPY(b + 1, pre, npre);
  put_u16(b + 1 + npre, (uint16_t)klen);
  memcpy(b + 3 + npre, key, klen);
  TP_COPY(b + 3 + npre + klen, suf, nsuf);
  *n = total;
  return b;
}

tp_status_t tp_store_open(tp_store_t *out, const tp_store_config_t *cfg) {
  if (!out) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "store open: out is NULL");
  *out = NULL;
  if (!cfg) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "store open: config is NULL");
  const char *host = cfg->host && *cfg->host ? cfg->host : "127.0.0.1";
  if (strlen(host) > 255) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "store open: host name longer than 255 bytes");
  if (cfg->port < (cfg->is_server ? 0 : 1) || cfg->port > 65535)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "store open: port must be in %d..65535, got %d",
                        cfg->is_server ? 0 : 1, cfg->port);
  if (!cfg->secret || cfg->secret_len < TP_STORE_MIN_SECRET || cfg->secret_len > TP_STORE_MAX_SECRET)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "store open: the secret must have %d..%d bytes, got %zu (set "
                        "TPCORE_STORE_SECRET to the same random value on every node)",
                        TP_STORE_MIN_SECRET, TP_STORE_MAX_SECRET, cfg->secret ? cfg->secret_len : 0);
  size_t max_value = cfg->max_value_bytes ? cfg->max_value_bytes : TP_STORE_DEFAULT_MAX_VALUE;
  if (max_value > TP_STORE_MAX_VALUE_CAP)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "store open: max_value_bytes %zu is above the cap %u", max_value,
                        TP_STORE_MAX_VALUE_CAP);
  if (cfg->max_clients > 65536)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "store open: max_clients %d is above 65536", cfg->max_clients);
  double timeout = cfg->timeout_s > 0 ? cfg->timeout_s : 300.0;
  if (!(timeout < 1e7)) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "store open: timeout %g s is too large", timeout);
  char port[16];
  snprintf(port, sizeof port, "%d", cfg->port);
  struct addrinfo hints, *ai = NULL;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC, hints.ai_socktype = SOCK_STREAM;
  int ge = getaddrinfo(host, port, &hints, &ai);
  if (ge != 0 || !ai)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "store open: cannot resolve host '%s': %s", host, gai_strerror(ge));
  tp_store_t s = calloc(1, sizeof *s);
  if (!s) {
    freeaddrinfo(ai);
    return tp_set_error(TP_ERR_NOMEM, "store open: out of memory");
  }
  pthread_mutex_init(&s->lock, NULL);
  pthread_mutex_init(&s->fd_lock, NULL);
  atomic_init(&s->interrupted, 0);
  s->fd = -1;
  memcpy(s->secret, cfg->secret, cfg->secret_len);
  s->secret_len = cfg->secret_len;
  s->timeout = timeout, s->max_value = max_value, s->port = cfg->port;
  memcpy(&s->addr, ai->ai_addr, ai->ai_addrlen);
  s->addrlen = ai->ai_addrlen;
  tp_status_t st = TP_SUCCESS;
  if (cfg->is_server) {
    st = tp_store_server_start(cfg, host, ai, timeout, max_value, &s->server);
    if (st == TP_SUCCESS) {
      s->port = tp_store_server_port(s->server);
      /* The server's own client: the bound address, loopback for a wildcard one. */
      if (s->addr.ss_family == AF_INET) {
        struct sockaddr_in *in = (struct sockaddr_in *)&s->addr;
        in->sin_port = htons((uint16_t)s->port);
        if (in->sin_addr.s_addr == htonl(INADDR_ANY)) in->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      } else if (s->addr.ss_family == AF_INET6) {
        struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)&s->addr;
        in6->sin6_port = htons((uint16_t)s->port);
        if (IN6_IS_ADDR_UNSPECIFIED(&in6->sin6_addr)) in6->sin6_addr = in6addr_loopback;
      }
    }
  }
  freeaddrinfo(ai);
  snprintf(s->where, sizeof s->where, "store at %s:%d", host, s->port);
  if (st == TP_SUCCESS) {
    pthread_mutex_lock(&s->lock);
    st = ensure_conn(s, tp_now() + timeout);
    pthread_mutex_unlock(&s->lock);
  }
  if (st != TP_SUCCESS) {
    char m[1024];
    snprintf(m, sizeof m, "%s", tp_last_error());
    tp_store_close(s);
    return tp_set_error(st, "%s", m);
  }
  *out = s;
  return TP_SUCCESS;
}

int tp_store_port(tp_store_t s) { return s ? s->port : -1; }

void tp_store_free(void *value) { free(value); }

tp_status_t tp_store_set(tp_store_t s, const char *key, const void *value, size_t nbytes) {
  size_t klen = 0, n = 0;
  TP_CHECK(check_key(s, "set", key, &klen));
  if (!value && nbytes) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "store set('%s'): value is NULL", key);
  if (nbytes > s->max_value)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT,
                        "store set('%s'): a value of %zu bytes is above max_value_bytes "
                        "(%zu)",
                        key, nbytes, s->max_value);
  uint8_t *b = key_body(OP_SET, NULL, 0, key, klen, value, nbytes, &n);
  if (!b) return tp_set_error(TP_ERR_NOMEM, "store set('%s'): out of memory", key);
  char what[TP_STORE_MAX_KEY + 32];
  snprintf(what, sizeof what, "set('%s')", key);
  int status;
  uint8_t *p = NULL;
  size_t pn;
  pthread_mutex_lock(&s->lock);
  tp_status_t st = request(s, b, n, what, &status, &p, &pn);
  pthread_mutex_unlock(&s->lock);
  free(b);
  free(p);
  return st;
}

static tp_status_t get_impl(tp_store_t s, const char *key, int wait, void **value, size_t *nbytes, int *found) {
  size_t klen = 0, n = 0;
  TP_CHECK(check_key(s, wait ? "get" : "try_get", key, &klen));
  if (!value || !nbytes) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "store get('%s'): value or nbytes is NULL", key);
  *value = NULL, *nbytes = 0;
  uint8_t flag = (uint8_t)wait;
  uint8_t *b = key_body(OP_GET, &flag, 1, key, klen, NULL, 0, &n);
  if (!b) return tp_set_error(TP_ERR_NOMEM, "store get('%s'): out of memory", key);
  char what[TP_STORE_MAX_KEY + 64];
  snprintf(what, sizeof what, wait ? "get('%s') waiting for the key" : "get('%s')", key);
  int status = ST_ERR;
  uint8_t *p = NULL;
  size_t pn = 0;
  pthread_mutex_lock(&s->lock);
  tp_status_t st = request(s, b, n, what, &status, &p, &pn);
  pthread_mutex_unlock(&s->lock);
  free(b);
  if (st != TP_SUCCESS) return st;
  if (status == ST_ABSENT) {
    free(p);
    if (found) *found = 0;
    return TP_SUCCESS;
  }
  if (found) *found = 1;
  *value = p, *nbytes = pn;
  return TP_SUCCESS;
}

tp_status_t tp_store_get(tp_store_t s, const char *key, void **value, size_t *nbytes) {
  return get_impl(s, key, 1, value, nbytes, NULL);
}

tp_status_t tp_store_try_get(tp_store_t s, const char *key, void **value, size_t *nbytes, int *found) {
  if (!found) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "store try_get: found is NULL");
  *found = 0;
  return get_impl(s, key, 0, value, nbytes, found);
}

tp_status_t tp_store_add(tp_store_t s, const char *key, int64_t delta, int64_t *result) {
  size_t klen = 0, n = 0;
  TP_CHECK(check_key(s, "add", key, &klen));
  uint8_t d[8];
  put_u64(d, (uint64_t)delta);
  uint8_t *b = key_body(OP_ADD, NULL, 0, key, klen, d, 8, &n);
  if (!b) return tp_set_error(TP_ERR_NOMEM, "store add('%s'): out of memory", key);
  char what[TP_STORE_MAX_KEY + 32];
  snprintf(what, sizeof what, "add('%s')", key);
  int status;
  uint8_t *p = NULL;
  size_t pn = 0;
  pthread_mutex_lock(&s->lock);
  tp_status_t st = request(s, b, n, what, &status, &p, &pn);
  pthread_mutex_unlock(&s->lock);
  free(b);
  if (st == TP_SUCCESS && pn != 8) st = tp_set_error(TP_ERR_REMOTE, "%s: %s: a malformed reply", s->where, what);
  if (st == TP_SUCCESS && result) *result = (int64_t)get_u64(p);
  free(p);
  return st;
}

tp_status_t tp_store_wait(tp_store_t s, const char *const *keys, int nkeys) {
  if (!s) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "store wait: the store is NULL");
  if (!keys || nkeys < 1 || nkeys > 4096)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "store wait: give 1..4096 keys, got %d%s", nkeys,
                        keys ? "" : " (keys is NULL)");
  size_t total = 3, klen = 0;
  for (int i = 0; i < nkeys; i++) {
    TP_CHECK(check_key(s, "wait", keys[i], &klen));
    if (!tp_add_size(total, 2 + klen, &total))
      return tp_set_error(TP_ERR_INVALID_ARGUMENT, "store wait: the keys are too long");
  }
  size_t cap;
  if (!max_request(s->max_value, &cap) || total > cap)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "store wait: %d keys take %zu bytes, above the message cap %zu", nkeys,
                        total, cap);
  uint8_t *b = malloc(total);
  if (!b) return tp_set_error(TP_ERR_NOMEM, "store wait: out of memory");
  b[0] = OP_WAIT;
  put_u16(b + 1, (uint16_t)nkeys);
  size_t off = 3;
  for (int i = 0; i < nkeys; i++) {
    klen = strlen(keys[i]);
    put_u16(b + off, (uint16_t)klen);
    memcpy(b + off + 2, keys[i], klen);
    off += 2 + klen;
  }
  char what[TP_STORE_MAX_KEY + 96];
  snprintf(what, sizeof what, "wait for %d key%s ('%s'%s)", nkeys, nkeys == 1 ? "" : "s", keys[0],
           nkeys > 1 ? ", ..." : "");
  int status;
  uint8_t *p = NULL;
  size_t pn;
  pthread_mutex_lock(&s->lock);
  tp_status_t st = request(s, b, total, what, &status, &p, &pn);
  pthread_mutex_unlock(&s->lock);
  free(b);
  free(p);
  return st;
}

tp_status_t tp_store_delete(tp_store_t s, const char *key, int *existed) {
  size_t klen = 0, n = 0;
  TP_CHECK(check_key(s, "delete", key, &klen));
  uint8_t *b = key_body(OP_DELETE, NULL, 0, key, klen, NULL, 0, &n);
  if (!b) return tp_set_error(TP_ERR_NOMEM, "store delete('%s'): out of memory", key);
  char what[TP_STORE_MAX_KEY + 32];
  snprintf(what, sizeof what, "delete('%s')", key);
  int status;
  uint8_t *p = NULL;
  size_t pn = 0;
  pthread_mutex_lock(&s->lock);
  tp_status_t st = request(s, b, n, what, &status, &p, &pn);
  pthread_mutex_unlock(&s->lock);
  free(b);
  if (st == TP_SUCCESS && pn != 1) st = tp_set_error(TP_ERR_REMOTE, "%s: %s: a malformed reply", s->where, what);
  if (st == TP_SUCCESS && existed) *existed = p[0];
  free(p);
  return st;
}

tp_status_t tp_store_barrier(tp_store_t s, const char *name, int n) {
  if (!s) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "store barrier: the store is NULL");
  if (!name || !*name || strlen(name) > TP_STORE_MAX_KEY - 48)
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "store barrier: name must have 1..%d bytes", TP_STORE_MAX_KEY - 48);
  if (n < 1) return tp_set_error(TP_ERR_INVALID_ARGUMENT, "store barrier('%s'): n must be >= 1, got %d", name, n);
  char count[TP_STORE_MAX_KEY + 1], done[TP_STORE_MAX_KEY + 1];
  snprintf(count, sizeof count, "tpcore/barrier/%s/count", name);
  int64_t k = 0;
  TP_CHECK(tp_store_add(s, count, 1, &k));
  int64_t round = (k - 1) / n;
  snprintf(done, sizeof done, "tpcore/barrier/%s/%" PRId64, name, round);
  if (k % n == 0) TP_CHECK(tp_store_set(s, done, "1", 1));
  void *v = NULL;
  size_t vn = 0;
  tp_status_t st = tp_store_get(s, done, &v, &vn);
  free(v);
  if (st == TP_ERR_TIMEOUT) {
    int64_t now = k;
    char m[1024];
    snprintf(m, sizeof m, "%s", tp_last_error());
    if (tp_store_add(s, count, 0, &now) != TP_SUCCESS) now = k;
    int64_t arrived = now - round * n;
    if (arrived > n) arrived = n;
    return tp_set_error(TP_ERR_TIMEOUT,
                        "store barrier('%s'): timed out after %g s with %" PRId64
                        " of %d "
                        "arrived (%s)",
                        name, s->timeout, arrived, n, m);
  }
  return st;
}

void tp_store_interrupt(tp_store_t s) {
  if (!s) return;
  atomic_store(&s->interrupted, 1);
  pthread_mutex_lock(&s->fd_lock);
  if (s->fd >= 0) shutdown(s->fd, SHUT_RDWR); /* wakes the call blocked on it */
  pthread_mutex_unlock(&s->fd_lock);
}

void tp_store_close(tp_store_t s) {
  if (!s) return;
  pthread_mutex_lock(&s->lock);
  drop_conn(s);
  pthread_mutex_unlock(&s->lock);
  tp_store_server_stop(s->server);
  s->server = NULL;
  pthread_mutex_destroy(&s->lock);
  pthread_mutex_destroy(&s->fd_lock);
  memset(s->secret, 0, sizeof s->secret);
  free(s);
}
