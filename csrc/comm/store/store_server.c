/*
 * The rendezvous store's server (tpcore/store.h, the wire format in store_proto.h): a TCP
 * key-value server in a thread of the process that opens the store with is_server.  One
 * poll() loop; the server never reads from a client that has a reply pending, so one reply
 * per client is buffered.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "store_proto.h"

/* Connections that have not authenticated yet: above UNAUTH_SOFT of them, a new one replaces
 * the oldest that has been waiting for UNAUTH_GRACE_S; above the hard cap (UNAUTH_HARD, at
 * most half of max_clients and a quarter of the fd limit: the rest stay for authenticated
 * clients), the oldest at once.  A client answers the greeting with its whole HELLO in one
 * write, so the oldest is the one that had the longest to do so; under a flood each keeps its
 * slot for the time the hard cap's worth of new connections take to arrive. */
#define UNAUTH_SOFT 64
#define UNAUTH_HARD 512
#define UNAUTH_GRACE_S 0.5
#define ACCEPTS_PER_ROUND 16
#define LISTEN_BACKLOG 4096 /* the kernel caps it at net.core.somaxconn */
#define NBUCKETS 1024

static void addr_text(const struct sockaddr *sa, socklen_t len, char *buf, size_t n) {
  char host[80], port[8];
  if (getnameinfo(sa, len, host, sizeof host, port, sizeof port, NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    snprintf(buf, n, "?");
    return;
  }
  if (sa->sa_family == AF_INET6) snprintf(buf, n, "[%s]:%s", host, port);
  else snprintf(buf, n, "%s:%s", host, port);
}

/* ------------------------------------------------------------ the server */

typedef struct entry {
  struct entry *next;
  size_t klen, vlen;
  uint8_t *val;
  uint8_t key[]; /* klen bytes */
} entry_t;

typedef struct {
  int fd;
  char peer[96];
  int authed;
  int closing;     /* flush the pending reply, then close */
  double opened;   /* tp_now() at accept: the oldest unauthenticated one is dropped first */
  double deadline; /* > 0: a message (or the HELLO) must be complete by then */
  uint8_t nonce[NONCE];
  uint8_t hdr[8];
  size_t hdr_have;
  uint8_t *body;
  size_t body_len, body_have;
  uint8_t *out;
  size_t out_len, out_off;
  double out_deadline;
  uint8_t *parked; /* a GET or WAIT body waiting for its keys */
  size_t parked_len;
} conn_t;

struct tp_store_server {
  int lfd;
  int wake[2];
  pthread_t thread;
  int started;
  char where[160];
  int port;
  uint8_t secret[TP_STORE_MAX_SECRET];
  size_t secret_len;
  double io_timeout;
  size_t max_value, max_total, total;
  int max_clients;
  int unauth_soft, unauth_hard;
  double accept_paused_until; /* out of fds: the listening socket rests until then */
  store_log_t log;
  conn_t *conns;
  int nconns;
  entry_t *buckets[NBUCKETS];
  size_t nentries;
};

/* One event in the server's log (rate-limited per kind, store_log.c). */
static void slog(server_t *sv, store_event_t kind, const char *fmt, ...) TP_PRINTF(3, 4);
static void slog(server_t *sv, store_event_t kind, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  tp_store_vlog(&sv->log, sv->where, kind, tp_now(), fmt, ap);
  va_end(ap);
}

static uint64_t hash_key(const uint8_t *k, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) h = (h ^ k[i]) * 1099511628211ull;
  return h;
}

static entry_t **find_slot(server_t *sv, const uint8_t *k, size_t n) {
  entry_t **pp = &sv->buckets[hash_key(k, n) % NBUCKETS];
  for (; *pp; pp = &(*pp)->next)
    if ((*pp)->klen == n && memcmp((*pp)->key, k, n) == 0) return pp;
  return pp;
}

static entry_t *find(server_t *sv, const uint8_t *k, size_t n) { return *find_slot(sv, k, n); }

/* Stores a copy of v under k; 0 with *why when refused. */
static int put(server_t *sv, const uint8_t *k, size_t kn, const uint8_t *v, size_t vn, const char **why) {
  entry_t **pp = find_slot(sv, k, kn);
  size_t old = *pp ? (*pp)->vlen : 0, grow = 0;
  if (vn > old && (!tp_add_size(sv->total, vn - old, &grow) || grow > sv->max_total)) {
    *why = "the store is full (max_total_bytes)";
    return 0;
  }
  uint8_t *nv = malloc(vn ? vn : 1);
  if (!nv) {
    *why = "out of memory";
    return 0;
  }
  TP_COPY(nv, v, vn);
  if (*pp) {
    free((*pp)->val);
    sv->total = sv->total - old + vn;
    (*pp)->val = nv, (*pp)->vlen = vn;
    return 1;
  }
  size_t need = 0;
  if (!tp_add_size(sv->total, vn + kn + sizeof(entry_t), &need) || need > sv->max_total) {
    free(nv);
    *why = "the store is full (max_total_bytes)";
    return 0;
  }
  entry_t *e = malloc(sizeof *e + kn);
  if (!e) {
    free(nv);
    *why = "out of memory";
    return 0;
  }
  e->next = NULL, e->klen = kn, e->vlen = vn, e->val = nv;
  memcpy(e->key, k, kn);
  *pp = e;
  sv->total = need;
  sv->nentries++;
  return 1;
}

static void conn_free_buffers(conn_t *c) {
  free(c->body), c->body = NULL;
  free(c->out), c->out = NULL;
  free(c->parked), c->parked = NULL;
}

static void conn_drop(server_t *sv, int i) {
  conn_t *c = &sv->conns[i];
  close(c->fd);
  conn_free_buffers(c);
  sv->conns[i] = sv->conns[sv->nconns - 1];
  sv->nconns--;
}

/* Queues one reply (status + payload); 0 when out of memory (the caller drops the client). */
static int reply(conn_t *c, int status, const void *p, size_t n) {
  size_t total;
  if (!tp_add_size(n, 9, &total)) return 0;
  uint8_t *b = malloc(total);
  if (!b) return 0;
  put_u64(b, (uint64_t)n + 1);
  b[8] = (uint8_t)status;
  TP_COPY(b + 9, p, n);
  free(c->out);
  c->out = b, c->out_len = total, c->out_off = 0;
  c->out_deadline = 0;
  return 1;
}

static int reply_err(conn_t *c, const char *fmt, ...) TP_PRINTF(2, 3);
static int reply_err(conn_t *c, const char *fmt, ...) {
  char msg[MAX_ERR_TEXT];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (n < 0) n = 0;
  if ((size_t)n >= sizeof msg) n = (int)sizeof msg - 1;
  return reply(c, ST_ERR, msg, (size_t)n);
}

/* A refused client: the sentence logged and sent (when it can still read it), then closed. */
static void refuse(server_t *sv, conn_t *c, store_event_t kind, const char *fmt, ...) TP_PRINTF(4, 5);
static void refuse(server_t *sv, conn_t *c, store_event_t kind, const char *fmt, ...) {
  char msg[MAX_ERR_TEXT - 64];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  slog(sv, kind, "client %s: %s; disconnected", c->peer, msg);
  free(c->body), c->body = NULL;
  free(c->parked), c->parked = NULL;
  c->hdr_have = 0;
  if (!reply_err(c, "store %s: %s; disconnected", sv->where, msg)) c->out_len = c->out_off = 0;
  c->closing = 1;
  c->deadline = 0;
}

/* Reads u16 klen + key at *off within body[0..n); 0 when malformed. */
static int take_key(const uint8_t *b, size_t n, size_t *off, const uint8_t **key, size_t *klen) {
  if (n - *off < 2) return 0;
  size_t k = get_u16(b + *off);
  if (k == 0 || k > TP_STORE_MAX_KEY || n - *off - 2 < k) return 0;
  *key = b + *off + 2, *klen = k;
  *off += 2 + k;
  return 1;
}

/* Whether a parked GET / WAIT is satisfied now; queues its reply when it is.  -1: malformed
 * (checked when it was parked, so never), 0: still waiting, 1: answered, 2: no memory. */
static int try_answer(server_t *sv, conn_t *c, const uint8_t *b, size_t n) {
  size_t off = 1;
  const uint8_t *key;
  size_t klen;
  if (b[0] == OP_GET) {
    off = 2;
    if (!take_key(b, n, &off, &key, &klen)) return -1;
    entry_t *e = find(sv, key, klen);
    if (!e) return 0;
    return reply(c, ST_OK, e->val, e->vlen) ? 1 : 2;
  }
  int nk = get_u16(b + 1);
  off = 3;
  for (int i = 0; i < nk; i++) {
    if (!take_key(b, n, &off, &key, &klen)) return -1;
    if (!find(sv, key, klen)) return 0;
  }
  return reply(c, ST_OK, NULL, 0) ? 1 : 2;
}

static int parse_i64(const uint8_t *p, size_t n, int64_t *out) {
  if (n == 0 || n > 20) return 0;
  char buf[24];
  memcpy(buf, p, n);
  buf[n] = '\0';
  char *end;
  errno = 0;
  long long v = strtoll(buf, &end, 10);
  if (errno || *end || end == buf) return 0;
  *out = v;
  return 1;
}

static void wake_waiters(server_t *sv) {
  for (int i = 0; i < sv->nconns; i++) {
    conn_t *c = &sv->conns[i];
    if (!c->parked || c->closing) continue;
    int r = try_answer(sv, c, c->parked, c->parked_len);
    if (r == 0) continue;
    free(c->parked), c->parked = NULL;
    if (r == 2) refuse(sv, c, STORE_EV_SYSTEM, "out of memory for a reply");
  }
}

static void handle_hello(server_t *sv, conn_t *c, const uint8_t *b, size_t n) {
  if (n != HELLO_BODY || b[0] != OP_HELLO) {
    refuse(sv, c, STORE_EV_PROTOCOL,
           "the first message is not a HELLO (not a tpcore store client, or a different version)");
    return;
  }
  uint8_t want[MAC], back[MAC];
  tp_store_hmac3(sv->secret, sv->secret_len, "tpcore-store-v1 client", c->nonce, b + 1, want);
  if (!tp_store_same_mac(want, b + 1 + NONCE)) {
    refuse(sv, c, STORE_EV_AUTH,
           "authentication failed: the client does not know this job's secret (TPCORE_STORE_SECRET "
           "must be the same on every node)");
    return;
  }
  tp_store_hmac3(sv->secret, sv->secret_len, "tpcore-store-v1 server", b + 1, c->nonce, back);
  if (!reply(c, ST_OK, back, MAC)) {
    refuse(sv, c, STORE_EV_SYSTEM, "out of memory for a reply");
    return;
  }
  c->authed = 1;
}

static void handle(server_t *sv, conn_t *c, uint8_t *b, size_t n) {
  if (!c->authed) {
    handle_hello(sv, c, b, n);
    return;
  }
  if (c->parked) {
    refuse(sv, c, STORE_EV_PROTOCOL, "sent a request while its previous one was still waiting");
    return;
  }
  const uint8_t *key;
  size_t klen, off = 1;
  const char *why;
  int ok = 1;
  switch (b[0]) {
    case OP_SET:
      if (!take_key(b, n, &off, &key, &klen)) break;
      if (n - off > sv->max_value) {
        refuse(sv, c, STORE_EV_PROTOCOL, "sent a value of %zu bytes (the most is %zu)", n - off, sv->max_value);
        return;
      }
      if (!put(sv, key, klen, b + off, n - off, &why)) ok = reply_err(c, "set of key '%.*s': %s", (int)klen, key, why);
      else ok = reply(c, ST_OK, NULL, 0), wake_waiters(sv);
      if (!ok) refuse(sv, c, STORE_EV_SYSTEM, "out of memory for a reply");
      return;
    case OP_GET: {
      if (n < 2) break;
      int wait = b[1];
      off = 2;
      if (!take_key(b, n, &off, &key, &klen) || off != n) break;
      entry_t *e = find(sv, key, klen);
      if (e) ok = reply(c, ST_OK, e->val, e->vlen);
      else if (!wait) ok = reply(c, ST_ABSENT, NULL, 0);
      else {
        c->parked = b, c->parked_len = n; /* owns the body now */
        c->body = NULL;
        return;
      }
      if (!ok) refuse(sv, c, STORE_EV_SYSTEM, "out of memory for a reply");
      return;
    }
    case OP_ADD: {
      if (!take_key(b, n, &off, &key, &klen) || n - off != 8) break;
      int64_t delta = (int64_t)get_u64(b + off), cur = 0, sum;
      entry_t *e = find(sv, key, klen);
      if (e && !parse_i64(e->val, e->vlen, &cur)) {
        ok = reply_err(c, "add to key '%.*s': its value is not a decimal integer", (int)klen, key);
      } else if (__builtin_add_overflow(cur, delta, &sum)) {
        ok = reply_err(c, "add to key '%.*s': %" PRId64 " + %" PRId64 " overflows int64", (int)klen, key, cur, delta);
      } else {
        char text[24];
        int tn = snprintf(text, sizeof text, "%" PRId64, sum);
        uint8_t v[8];
        put_u64(v, (uint64_t)sum);
        if (!put(sv, key, klen, (const uint8_t *)text, (size_t)tn, &why))
          ok = reply_err(c, "add to key '%.*s': %s", (int)klen, key, why);
        else ok = reply(c, ST_OK, v, 8), wake_waiters(sv);
      }
      if (!ok) refuse(sv, c, STORE_EV_SYSTEM, "out of memory for a reply");
      return;
    }
    case OP_WAIT: {
      if (n < 3) break;
      int nk = get_u16(b + 1);
      off = 3;
      int good = nk > 0;
      for (int i = 0; good && i < nk; i++) good = take_key(b, n, &off, &key, &klen);
      if (!good || off != n) break;
      c->parked = b, c->parked_len = n;
      c->body = NULL;
      int r = try_answer(sv, c, b, n);
      if (r != 0) free(c->parked), c->parked = NULL;
      if (r == 2) refuse(sv, c, STORE_EV_SYSTEM, "out of memory for a reply");
      return;
    }
    case OP_DELETE: {
      if (!take_key(b, n, &off, &key, &klen) || off != n) break;
      entry_t **pp = find_slot(sv, key, klen);
      uint8_t existed = *pp != NULL;
      if (*pp) {
        entry_t *e = *pp;
        *pp = e->next;
        sv->total -= e->vlen + e->klen + sizeof(entry_t);
        sv->nentries--;
        free(e->val);
        free(e);
      }
      if (!reply(c, ST_OK, &existed, 1)) refuse(sv, c, STORE_EV_SYSTEM, "out of memory for a reply");
      return;
    }
    default: refuse(sv, c, STORE_EV_PROTOCOL, "sent an unknown request (op %u)", (unsigned)b[0]); return;
  }
  refuse(sv, c, STORE_EV_PROTOCOL, "sent a malformed request (op %u, %zu bytes: bad key length or layout)",
         (unsigned)b[0], n);
}

/* One read from a readable client; its message handled when complete. */
static void on_readable(server_t *sv, conn_t *c, double now) {
  if (c->hdr_have < 8) {
    ssize_t r = recv(c->fd, c->hdr + c->hdr_have, 8 - c->hdr_have, 0);
    if (r == 0) {
      if (c->hdr_have) slog(sv, STORE_EV_CLOSED, "client %s: closed the connection inside a message", c->peer);
      c->closing = 2;
      return;
    }
    if (r < 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) c->closing = 2;
      return;
    }
    if (c->deadline == 0) c->deadline = now + sv->io_timeout;
    c->hdr_have += (size_t)r;
    if (c->hdr_have < 8) return;
    uint64_t len = get_u64(c->hdr);
    size_t cap = HELLO_BODY;
    if (c->authed && !max_request(sv->max_value, &cap)) cap = SIZE_MAX;
    if (len == 0 || len > cap) {
      refuse(sv, c, STORE_EV_PROTOCOL,
             "sent a message length of %" PRIu64 " bytes (as int64: %" PRId64 "; it must be 1..%zu%s)", len,
             (int64_t)len, cap, c->authed ? "" : " before authentication");
      return;
    }
    c->body = malloc((size_t)len);
    if (!c->body) {
      refuse(sv, c, STORE_EV_SYSTEM, "out of memory for a message of %" PRIu64 " bytes", len);
      return;
    }
    c->body_len = (size_t)len, c->body_have = 0;
  }
  ssize_t r = recv(c->fd, c->body + c->body_have, c->body_len - c->body_have, 0);
  if (r == 0) {
    slog(sv, STORE_EV_CLOSED, "client %s: closed the connection inside a message", c->peer);
    c->closing = 2;
    return;
  }
  if (r < 0) {
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) c->closing = 2;
    return;
  }
  c->body_have += (size_t)r;
  if (c->body_have < c->body_len) return;
  uint8_t *b = c->body;
  size_t n = c->body_len;
  c->hdr_have = 0;
  c->deadline = 0;
  handle(sv, c, b, n);
  if (c->body == b) free(b); /* not parked */
  c->body = NULL;
}

static void on_writable(server_t *sv, conn_t *c, double now) {
  ssize_t w = send(c->fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL);
  if (w < 0) {
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) c->closing = 2;
    return;
  }
  c->out_off += (size_t)w;
  if (c->out_off == c->out_len) {
    free(c->out), c->out = NULL;
    c->out_len = c->out_off = 0, c->out_deadline = 0;
    if (c->closing) c->closing = 2;
  }
  (void)sv, (void)now;
}

/* The oldest connection that has not authenticated (nor been refused); *count: how many. */
static int oldest_unauthed(server_t *sv, int *count) {
  int n = 0, oldest = -1;
  for (int i = 0; i < sv->nconns; i++) {
    conn_t *c = &sv->conns[i];
    if (c->authed || c->closing) continue;
    n++;
    if (oldest < 0 || c->opened < sv->conns[oldest].opened) oldest = i;
  }
  *count = n;
  return oldest;
}

/* Room for one more unauthenticated connection (UNAUTH_* above): the oldest one is dropped
 * when there are UNAUTH_SOFT and it has had UNAUTH_GRACE_S, or there are unauth_hard, or
 * `force` (the server is out of fds).  Its HELLO may have come in since the last poll: then it
 * is read instead, and one that has closed is let go without a word. */
static void make_room(server_t *sv, double now, int force, const char *why) {
  for (int tries = 0; tries < 4; tries++) {
    int n, v = oldest_unauthed(sv, &n);
    if (v < 0 || (!force && n < sv->unauth_soft)) return;
    conn_t *c = &sv->conns[v];
    char b;
    ssize_t r = c->out_len || tries == 3 ? -1 : recv(c->fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    if (r == 0) {
      conn_drop(sv, v);
      if (force) return;
      continue;
    }
    if (r > 0) {
      on_readable(sv, c, now);
      continue;
    }
    if (!force && n < sv->unauth_hard && now - c->opened < UNAUTH_GRACE_S) return;
    slog(sv, STORE_EV_EVICTED,
         "client %s: dropped before it authenticated, %.3f s after it connected (%d connections were "
         "authenticating at once%s)",
         c->peer, now - c->opened, n, why);
    conn_drop(sv, v);
    return;
  }
}

/* Accepts one connection; 0 when there was none to accept. */
static int on_accept(server_t *sv, double now) {
  struct sockaddr_storage sa;
  socklen_t sl = sizeof sa;
  int fd = accept4(sv->lfd, (struct sockaddr *)&sa, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
  if (fd < 0) {
    int e = errno, n;
    if (e != EMFILE && e != ENFILE && e != ENOBUFS && e != ENOMEM) return e == EINTR || e == ECONNABORTED;
    slog(sv, STORE_EV_SYSTEM, "cannot accept a connection: %s (%d connections are open)", strerror(e), sv->nconns);
    /* The pending connection keeps the listening socket readable: free an fd, or rest. */
    if (oldest_unauthed(sv, &n) >= 0) make_room(sv, now, 1, "; the server is out of file descriptors");
    else sv->accept_paused_until = now + 0.1;
    return 0;
  }
  char peer[96];
  addr_text((struct sockaddr *)&sa, sl, peer, sizeof peer);
  make_room(sv, now, 0, "");
  if (sv->nconns >= sv->max_clients) {
    slog(sv, STORE_EV_FULL, "client %s: refused, %d connections are open already (max_clients)", peer, sv->nconns);
    close(fd);
    return 1;
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  conn_t *c = &sv->conns[sv->nconns];
  memset(c, 0, sizeof *c);
  c->fd = fd, c->opened = now, c->deadline = now + sv->io_timeout;
  snprintf(c->peer, sizeof c->peer, "%s", peer);
  uint8_t g[GREETING];
  memcpy(g, "TPCS", 4);
  g[4] = STORE_VERSION & 0xff, g[5] = g[6] = g[7] = 0;
  if (!tp_store_random_bytes(c->nonce, NONCE)) {
    slog(sv, STORE_EV_SYSTEM, "client %s: getrandom failed: %s", peer, strerror(errno));
    close(fd);
    return 1;
  }
  memcpy(g + 8, c->nonce, NONCE);
  c->out = malloc(GREETING);
  if (!c->out) {
    slog(sv, STORE_EV_SYSTEM, "client %s: out of memory for the greeting", peer);
    close(fd);
    return 1;
  }
  memcpy(c->out, g, GREETING);
  c->out_len = GREETING;
  sv->nconns++;
  on_writable(sv, c, now); /* the greeting goes out now: the client's clock starts at once */
  return 1;
}

static void *serve(void *arg) {
  server_t *sv = arg;
  struct pollfd *pf = malloc(sizeof *pf * (size_t)(sv->max_clients + 2));
  if (!pf) {
    slog(sv, STORE_EV_SYSTEM, "out of memory: the store does not serve");
    return NULL;
  }
  for (;;) {
    double now = tp_now(), next = now + 1.0;
    /* Deadlines: a message or the HELLO not complete, a reply not read. */
    for (int i = sv->nconns - 1; i >= 0; i--) {
      conn_t *c = &sv->conns[i];
      if (c->out_len && c->out_deadline == 0) c->out_deadline = now + sv->io_timeout;
      if (c->closing == 2 || (c->closing && !c->out_len)) {
        conn_drop(sv, i);
        continue;
      }
      if (c->deadline > 0 && now >= c->deadline && !c->closing) {
        if (!c->authed)
          slog(sv, STORE_EV_STALLED, "client %s: did not authenticate within %g s; disconnected", c->peer,
               sv->io_timeout);
        else
          slog(sv, STORE_EV_STALLED, "client %s: sent part of a message and then nothing for %g s; disconnected",
               c->peer, sv->io_timeout);
        conn_drop(sv, i);
        continue;
      }
      if (c->out_len && now >= c->out_deadline) {
        slog(sv, STORE_EV_STALLED, "client %s: did not read its reply within %g s; disconnected", c->peer,
             sv->io_timeout);
        conn_drop(sv, i);
        continue;
      }
      if (c->deadline > 0 && c->deadline < next) next = c->deadline;
      if (c->out_len && c->out_deadline < next) next = c->out_deadline;
    }
    pf[0] = (struct pollfd){.fd = sv->wake[0], .events = POLLIN};
    tp_store_log_flush(&sv->log, sv->where, now, 0);
    int resting = now < sv->accept_paused_until;
    if (resting && sv->accept_paused_until < next) next = sv->accept_paused_until;
    pf[1] = (struct pollfd){.fd = sv->lfd, .events = resting ? 0 : POLLIN};
    for (int i = 0; i < sv->nconns; i++) {
      conn_t *c = &sv->conns[i];
      short ev = c->out_len ? POLLOUT : (c->closing ? 0 : POLLIN);
      pf[2 + i] = (struct pollfd){.fd = c->fd, .events = ev};
    }
    int ms = (int)((next - now) * 1000.0) + 1;
    if (ms < 1) ms = 1;
    int nconns = sv->nconns;
    int r = poll(pf, (nfds_t)(2 + nconns), ms);
    if (r < 0) {
      if (errno == EINTR) continue;
      slog(sv, STORE_EV_SYSTEM, "poll failed: %s; the store stops serving", strerror(errno));
      break;
    }
    if (pf[0].revents) { /* close: the replies already due go out (one try, never blocking) */
      for (int i = 0; i < sv->nconns; i++)
        if (sv->conns[i].out_len) on_writable(sv, &sv->conns[i], now);
      break;
    }
    now = tp_now();
    for (int i = 0; i < nconns; i++) {
      conn_t *c = &sv->conns[i];
      short re = pf[2 + i].revents;
      if (!re || c->closing == 2) continue;
      if (re & POLLOUT) on_writable(sv, c, now);
      else if (re & POLLIN) on_readable(sv, c, now);
      else if (re & (POLLHUP | POLLERR | POLLNVAL)) c->closing = 2;
    }
    /* A few at a time: a flood waits in the kernel's queue, not the clients behind it. */
    if (pf[1].revents & POLLIN)
      for (int k = 0; k < ACCEPTS_PER_ROUND && on_accept(sv, now); k++) {
      }
  }
  tp_store_log_flush(&sv->log, sv->where, tp_now(), 1);
  free(pf);
  return NULL;
}

static void server_free(server_t *sv) {
  if (!sv) return;
  for (int i = 0; i < sv->nconns; i++) {
    close(sv->conns[i].fd);
    conn_free_buffers(&sv->conns[i]);
  }
  for (int b = 0; b < NBUCKETS; b++)
    for (entry_t *e = sv->buckets[b], *nx; e; e = nx) {
      nx = e->next;
      free(e->val);
      free(e);
    }
  free(sv->conns);
  if (sv->lfd >= 0) close(sv->lfd);
  if (sv->wake[0] >= 0) close(sv->wake[0]);
  if (sv->wake[1] >= 0) close(sv->wake[1]);
  free(sv);
}

void tp_store_server_stop(server_t *sv) {
  if (!sv) return;
  if (sv->started) {
    char one = 1;
    while (write(sv->wake[1], &one, 1) < 0 && errno == EINTR) {
    }
    pthread_join(sv->thread, NULL);
  }
  server_free(sv);
}

tp_status_t tp_store_server_start(const tp_store_config_t *cfg, const char *host, const struct addrinfo *ai,
                                  double timeout, size_t max_value, server_t **out) {
  server_t *sv = calloc(1, sizeof *sv);
  if (!sv) return tp_set_error(TP_ERR_NOMEM, "store: out of memory");
  sv->lfd = -1, sv->wake[0] = sv->wake[1] = -1;
  memcpy(sv->secret, cfg->secret, cfg->secret_len);
  sv->secret_len = cfg->secret_len;
  sv->io_timeout = cfg->io_timeout_s > 0 ? cfg->io_timeout_s : timeout;
  sv->max_value = max_value;
  sv->max_total = cfg->max_total_bytes ? cfg->max_total_bytes : ((size_t)256 << 20);
  sv->max_clients = cfg->max_clients > 0 ? cfg->max_clients : 1024;
  sv->log.quiet = cfg->quiet;
  sv->log.window_start = tp_now();
  /* Half the connections, and three quarters of the fds, stay for authenticated clients. */
  int hard = sv->max_clients / 2 < UNAUTH_HARD ? sv->max_clients / 2 : UNAUTH_HARD;
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && (rlim_t)hard > rl.rlim_cur / 4)
    hard = (int)(rl.rlim_cur / 4);
  sv->unauth_hard = hard > 1 ? hard : 1;
  sv->unauth_soft = sv->unauth_hard < UNAUTH_SOFT ? sv->unauth_hard : UNAUTH_SOFT;
  snprintf(sv->where, sizeof sv->where, "%s:%d", host, cfg->port);
  sv->conns = calloc((size_t)sv->max_clients, sizeof(conn_t));
  if (!sv->conns || pipe2(sv->wake, O_CLOEXEC | O_NONBLOCK) != 0) {
    server_free(sv);
    return tp_set_error(TP_ERR_SYSTEM, "store %s: cannot set up the server: %s", host, strerror(errno));
  }
  sv->lfd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  int one = 1;
  if (sv->lfd < 0 || setsockopt(sv->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0) {
    int e = errno;
    server_free(sv);
    return tp_set_error(TP_ERR_SYSTEM, "store %s: cannot make a socket: %s", host, strerror(e));
  }
  if (bind(sv->lfd, ai->ai_addr, ai->ai_addrlen) != 0) {
    int e = errno;
    server_free(sv);
    if (e == EADDRINUSE)
      return tp_set_error(TP_ERR_SYSTEM,
                          "store: port %d on %s is already in use (another job's store or another "
                          "program listens there: choose another MASTER_PORT / --master-port)",
                          cfg->port, host);
    if (e == EADDRNOTAVAIL)
      return tp_set_error(TP_ERR_SYSTEM,
                          "store: cannot listen on %s:%d: %s is not an address of this host (the "
                          "store's server runs on the host of MASTER_ADDR)",
                          host, cfg->port, host);
    return tp_set_error(TP_ERR_SYSTEM, "store: cannot listen on %s:%d: %s", host, cfg->port, strerror(e));
  }
  if (listen(sv->lfd, LISTEN_BACKLOG) != 0) {
    int e = errno;
    server_free(sv);
    return tp_set_error(TP_ERR_SYSTEM, "store: listen on %s:%d failed: %s", host, cfg->port, strerror(e));
  }
  struct sockaddr_storage sa;
  socklen_t sl = sizeof sa;
  getsockname(sv->lfd, (struct sockaddr *)&sa, &sl);
  sv->port = sa.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&sa)->sin6_port)
                                      : ntohs(((struct sockaddr_in *)&sa)->sin_port);
  snprintf(sv->where, sizeof sv->where, "%s:%d", host, sv->port);
  /* The server thread takes no signals: they stay with the application's threads. */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  int e = pthread_create(&sv->thread, NULL, serve, sv);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (e != 0) {
    server_free(sv);
    return tp_set_error(TP_ERR_SYSTEM, "store %s: cannot start the server thread: %s", host, strerror(e));
  }
  sv->started = 1;
  *out = sv;
  return TP_SUCCESS;
}

int tp_store_server_port(const server_t *sv) { return sv->port; }
