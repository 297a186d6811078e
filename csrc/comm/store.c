/*
 * The rendezvous store (tpcore/store.h): a TCP key-value server in a thread of the
 * process that opens it with is_server, and its clients.
 *
 * Wire format (all integers little-endian):
 *   greeting, server -> client, raw:  "TPCS" u32 version  nonce_s[32]
 *   every other message:              u64 body_length  body[body_length]
 *   request body:                     u8 op, then
 *     HELLO   nonce_c[32] mac[32]     mac = HMAC-SHA256(secret, "tpcore-store-v1 client" nonce_s nonce_c)
 *     SET     u16 klen key value
 *     GET     u8 wait u16 klen key    (wait 0: answer at once, ABSENT when missing)
 *     ADD     u16 klen key i64 delta
 *     WAIT    u16 n, n x (u16 klen key)
 *     DELETE  u16 klen key
 *   reply body:                       u8 status (OK, ERR, ABSENT), then
 *     OK: HELLO HMAC(secret, "tpcore-store-v1 server" nonce_c nonce_s), GET the value, ADD i64,
 *         DELETE u8 existed;  ERR: the sentence.
 * A body longer than the cap (before HELLO: the HELLO's size; after: a key, a value and
 * their headers) or empty is refused before anything is allocated.  The server never
 * reads from a client that has a reply pending, so one reply per client is buffered.
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
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "../core/core_impl.h"
#include "tpcore/store.h"

#define STORE_VERSION 1u
#define NONCE 32
#define MAC 32
#define GREETING (4 + 4 + NONCE)
#define HELLO_BODY (1 + NONCE + MAC)
#define MAX_ERR_TEXT 1024
#define MAX_UNAUTHED 64 /* connections not yet authenticated, at once: the oldest is dropped */
#define NBUCKETS 1024

enum { OP_HELLO = 1, OP_SET = 2, OP_GET = 3, OP_ADD = 4, OP_WAIT = 5, OP_DELETE = 6 };
enum { ST_OK = 0, ST_ERR = 1, ST_ABSENT = 2 };

/* ------------------------------------------------------------ SHA-256, HMAC */

typedef struct {
  uint32_t h[8];
  uint64_t bytes;
  uint8_t buf[64];
  size_t n;
} sha256_t;

static const uint32_t sha_k[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

static inline uint32_t ror(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static void sha_block(sha256_t *s, const uint8_t *p) {
  uint32_t w[64];
  for (int i = 0; i < 16; i++)
    w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
  for (int i = 16; i < 64; i++) {
    uint32_t s0 = ror(w[i - 15], 7) ^ ror(w[i - 15], 18) ^ (w[i - 15] >> 3);
    uint32_t s1 = ror(w[i - 2], 17) ^ ror(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = s->h[0], b = s->h[1], c = s->h[2], d = s->h[3], e = s->h[4], f = s->h[5], g = s->h[6], h = s->h[7];
  for (int i = 0; i < 64; i++) {
    uint32_t t1 = h + (ror(e, 6) ^ ror(e, 11) ^ ror(e, 25)) + ((e & f) ^ (~e & g)) + sha_k[i] + w[i];
    uint32_t t2 = (ror(a, 2) ^ ror(a, 13) ^ ror(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    h = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
  }
  s->h[0] += a, s->h[1] += b, s->h[2] += c, s->h[3] += d, s->h[4] += e, s->h[5] += f, s->h[6] += g, s->h[7] += h;
}

static void sha_init(sha256_t *s) {
  static const uint32_t h0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  memcpy(s->h, h0, sizeof h0);
  s->bytes = 0, s->n = 0;
}

static void sha_update(sha256_t *s, const void *data, size_t len) {
  const uint8_t *p = data;
  s->bytes += len;
  while (len) {
    size_t take = 64 - s->n < len ? 64 - s->n : len;
    memcpy(s->buf + s->n, p, take);
    s->n += take, p += take, len -= take;
    if (s->n == 64) {
      sha_block(s, s->buf);
      s->n = 0;
    }
  }
}

static void sha_final(sha256_t *s, uint8_t out[32]) {
  uint64_t bits = s->bytes * 8;
  uint8_t pad = 0x80, zero = 0, len[8];
  sha_update(s, &pad, 1);
  while (s->n != 56) sha_update(s, &zero, 1);
  for (int i = 0; i < 8; i++) len[i] = (uint8_t)(bits >> (56 - 8 * i));
  sha_update(s, len, 8);
  for (int i = 0; i < 8; i++)
    out[4 * i] = (uint8_t)(s->h[i] >> 24), out[4 * i + 1] = (uint8_t)(s->h[i] >> 16),
    out[4 * i + 2] = (uint8_t)(s->h[i] >> 8), out[4 * i + 3] = (uint8_t)s->h[i];
}

/* HMAC-SHA256(key, label || a || b) with 32-byte a and b. */
static void hmac3(const uint8_t *key, size_t klen, const char *label, const uint8_t *a, const uint8_t *b,
                  uint8_t out[32]) {
  uint8_t k[64] = {0}, ipad[64], opad[64], inner[32];
  if (klen > 64) {
    sha256_t s;
    sha_init(&s);
    sha_update(&s, key, klen);
    sha_final(&s, k);
  } else {
    memcpy(k, key, klen);
  }
  for (int i = 0; i < 64; i++) ipad[i] = k[i] ^ 0x36, opad[i] = k[i] ^ 0x5c;
  sha256_t s;
  sha_init(&s);
  sha_update(&s, ipad, 64);
  sha_update(&s, label, strlen(label));
  sha_update(&s, a, 32);
  sha_update(&s, b, 32);
  sha_final(&s, inner);
  sha_init(&s);
  sha_update(&s, opad, 64);
  sha_update(&s, inner, 32);
  sha_final(&s, out);
}

static int same_mac(const uint8_t *a, const uint8_t *b) {
  volatile uint8_t d = 0;
  for (int i = 0; i < MAC; i++) d |= a[i] ^ b[i];
  return d == 0;
}

static int random_bytes(uint8_t *p, size_t n) {
  while (n) {
    ssize_t r = getrandom(p, n, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      return 0;
    }
    p += r, n -= (size_t)r;
  }
  return 1;
}

/* ------------------------------------------------------------ little-endian fields */

static void put_u16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8); }
static void put_u64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint16_t get_u16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static uint64_t get_u64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
  return v;
}

/* The most a request body may be once authenticated: op, GET's flag, a key and its length,
 * a value; a WAIT of many keys fits in the same bound. */
static int max_request(size_t max_value, size_t *out) {
  return tp_add_size(max_value, 1 + 1 + 2 + TP_STORE_MAX_KEY + 8, out);
}

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
  int closing;   /* flush the pending reply, then close */
  double opened; /* tp_now() at accept: the oldest unauthenticated one is dropped first */
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

typedef struct {
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
  int max_clients, quiet;
  conn_t *conns;
  int nconns;
  entry_t *buckets[NBUCKETS];
  size_t nentries;
} server_t;

static void slog(server_t *sv, const char *fmt, ...) TP_PRINTF(2, 3);
static void slog(server_t *sv, const char *fmt, ...) {
  if (sv->quiet) return;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  fprintf(stderr, "tpcore store %s: %s\n", sv->where, msg);
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
static void refuse(server_t *sv, conn_t *c, const char *fmt, ...) TP_PRINTF(3, 4);
static void refuse(server_t *sv, conn_t *c, const char *fmt, ...) {
  char msg[MAX_ERR_TEXT - 64];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  slog(sv, "client %s: %s; disconnected", c->peer, msg);
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
    if (r == 2) refuse(sv, c, "out of memory for a reply");
  }
}

static void handle_hello(server_t *sv, conn_t *c, const uint8_t *b, size_t n) {
  if (n != HELLO_BODY || b[0] != OP_HELLO) {
    refuse(sv, c, "the first message is not a HELLO (not a tpcore store client, or a different version)");
    return;
  }
  uint8_t want[MAC], back[MAC];
  hmac3(sv->secret, sv->secret_len, "tpcore-store-v1 client", c->nonce, b + 1, want);
  if (!same_mac(want, b + 1 + NONCE)) {
    refuse(sv, c, "authentication failed: the client does not know this job's secret (TPCORE_STORE_SECRET "
                  "must be the same on every node)");
    return;
  }
  hmac3(sv->secret, sv->secret_len, "tpcore-store-v1 server", b + 1, c->nonce, back);
  if (!reply(c, ST_OK, back, MAC)) {
    refuse(sv, c, "out of memory for a reply");
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
    refuse(sv, c, "sent a request while its previous one was still waiting");
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
        refuse(sv, c, "sent a value of %zu bytes (the most is %zu)", n - off, sv->max_value);
        return;
      }
      if (!put(sv, key, klen, b + off, n - off, &why)) ok = reply_err(c, "set of key '%.*s': %s", (int)klen, key, why);
      else ok = reply(c, ST_OK, NULL, 0), wake_waiters(sv);
      if (!ok) refuse(sv, c, "out of memory for a reply");
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
      if (!ok) refuse(sv, c, "out of memory for a reply");
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
      if (!ok) refuse(sv, c, "out of memory for a reply");
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
      if (r == 2) refuse(sv, c, "out of memory for a reply");
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
      if (!reply(c, ST_OK, &existed, 1)) refuse(sv, c, "out of memory for a reply");
      return;
    }
    default:
      refuse(sv, c, "sent an unknown request (op %u)", (unsigned)b[0]);
      return;
  }
  refuse(sv, c, "sent a malformed request (op %u, %zu bytes: bad key length or layout)", (unsigned)b[0], n);
}

/* One read from a readable client; its message handled when complete. */
static void on_readable(server_t *sv, conn_t *c, double now) {
  if (c->hdr_have < 8) {
    ssize_t r = recv(c->fd, c->hdr + c->hdr_have, 8 - c->hdr_have, 0);
    if (r == 0) {
      if (c->hdr_have) slog(sv, "client %s: closed the connection inside a message", c->peer);
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
      refuse(sv, c, "sent a message length of %" PRIu64 " bytes (as int64: %" PRId64 "; it must be 1..%zu%s)",
             len, (int64_t)len, cap, c->authed ? "" : " before authentication");
      return;
    }
    c->body = malloc((size_t)len);
    if (!c->body) {
      refuse(sv, c, "out of memory for a message of %" PRIu64 " bytes", len);
      return;
    }
    c->body_len = (size_t)len, c->body_have = 0;
  }
  ssize_t r = recv(c->fd, c->body + c->body_have, c->body_len - c->body_have, 0);
  if (r == 0) {
    slog(sv, "client %s: closed the connection inside a message", c->peer);
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

static void on_accept(server_t *sv, double now) {
  struct sockaddr_storage sa;
  socklen_t sl = sizeof sa;
  int fd = accept4(sv->lfd, (struct sockaddr *)&sa, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
  if (fd < 0) return;
  char peer[96];
  addr_text((struct sockaddr *)&sa, sl, peer, sizeof peer);
  if (sv->nconns >= sv->max_clients) {
    slog(sv, "client %s: refused, %d connections are open already (max_clients)", peer, sv->nconns);
    close(fd);
    return;
  }
  int unauth = 0, oldest = -1;
  for (int i = 0; i < sv->nconns; i++)
    if (!sv->conns[i].authed && !sv->conns[i].closing) {
      unauth++;
      if (oldest < 0 || sv->conns[i].opened < sv->conns[oldest].opened) oldest = i;
    }
  if (unauth >= MAX_UNAUTHED && oldest >= 0) {
    slog(sv, "client %s: dropped unauthenticated (%d clients were authenticating at once)",
         sv->conns[oldest].peer, unauth);
    conn_drop(sv, oldest);
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
  if (!random_bytes(c->nonce, NONCE)) {
    slog(sv, "client %s: getrandom failed: %s", peer, strerror(errno));
    close(fd);
    return;
  }
  memcpy(g + 8, c->nonce, NONCE);
  c->out = malloc(GREETING);
  if (!c->out) {
    close(fd);
    return;
  }
  memcpy(c->out, g, GREETING);
  c->out_len = GREETING;
  sv->nconns++;
}

static void *serve(void *arg) {
  server_t *sv = arg;
  struct pollfd *pf = malloc(sizeof *pf * (size_t)(sv->max_clients + 2));
  if (!pf) {
    slog(sv, "out of memory: the store does not serve");
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
        if (!c->authed) slog(sv, "client %s: did not authenticate within %g s; disconnected", c->peer, sv->io_timeout);
        else slog(sv, "client %s: sent part of a message and then nothing for %g s; disconnected", c->peer,
                  sv->io_timeout);
        conn_drop(sv, i);
        continue;
      }
      if (c->out_len && now >= c->out_deadline) {
        slog(sv, "client %s: did not read its reply within %g s; disconnected", c->peer, sv->io_timeout);
        conn_drop(sv, i);
        continue;
      }
      if (c->deadline > 0 && c->deadline < next) next = c->deadline;
      if (c->out_len && c->out_deadline < next) next = c->out_deadline;
    }
    pf[0] = (struct pollfd){.fd = sv->wake[0], .events = POLLIN};
    pf[1] = (struct pollfd){.fd = sv->lfd, .events = POLLIN};
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
      slog(sv, "poll failed: %s; the store stops serving", strerror(errno));
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
    if (pf[1].revents & POLLIN) on_accept(sv, now);
  }
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

static void server_stop(server_t *sv) {
  if (!sv) return;
  if (sv->started) {
    char one = 1;
    while (write(sv->wake[1], &one, 1) < 0 && errno == EINTR) {
    }
    pthread_join(sv->thread, NULL);
  }
  server_free(sv);
}

static tp_status_t server_start(const tp_store_config_t *cfg, const char *host, const struct addrinfo *ai,
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
  sv->quiet = cfg->quiet;
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
      return tp_set_error(TP_ERR_SYSTEM, "store: port %d on %s is already in use (another job's store or another "
                          "program listens there: choose another MASTER_PORT / --master-port)", cfg->port, host);
    if (e == EADDRNOTAVAIL)
      return tp_set_error(TP_ERR_SYSTEM, "store: cannot listen on %s:%d: %s is not an address of this host (the "
                          "store's server runs on the host of MASTER_ADDR)", host, cfg->port, host);
    return tp_set_error(TP_ERR_SYSTEM, "store: cannot listen on %s:%d: %s", host, cfg->port, strerror(e));
  }
  if (listen(sv->lfd, 128) != 0) {
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

/* ------------------------------------------------------------ the client */

struct tp_store {
  pthread_mutex_t lock;    /* one call at a time */
  pthread_mutex_t fd_lock; /* fd's changes against tp_store_interrupt from another thread */
  atomic_int interrupted;
  int fd;
  char where[300]; /* "store at host:port" */
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
    return tp_set_error(TP_ERR_REMOTE, "%s: %s: the store closed the connection%s%s (its host process exited, or "
                        "it refused this client: see its log)", s->where, what, e ? ": " : "", e ? strerror(e) : "");
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
    return tp_set_error(TP_ERR_REMOTE, "%s: %s: the server sent a reply of %" PRIu64 " bytes (the most is %zu: "
                        "not a tpcore store, or a larger max_value_bytes there)", s->where, what, len, cap);
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

static tp_status_t connect_once(tp_store_t s, double deadline, int *refused) {
  *refused = 0;
  int fd = socket(s->addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return tp_set_error(TP_ERR_SYSTEM, "%s: socket: %s", s->where, strerror(errno));
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  int e = 0;
  if (connect(fd, (struct sockaddr *)&s->addr, s->addrlen) != 0) {
    e = errno;
    if (e == EINPROGRESS) {
      double left = deadline - tp_now();
      struct pollfd pf = {.fd = fd, .events = POLLOUT};
      int r = 0;
      while (left > 0 && !atomic_load(&s->interrupted) && (r = poll(&pf, 1, poll_ms(left))) == 0)
        left = deadline - tp_now();
      socklen_t el = sizeof e;
      if (r > 0) getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &el);
      else e = ETIMEDOUT;
    }
  }
  if (e != 0) {
    close(fd);
    *refused = 1;
    return tp_set_error(TP_ERR_TIMEOUT, "%s: cannot connect within %g s: %s (is the store's host up and "
                        "MASTER_ADDR / MASTER_PORT right?)", s->where, s->timeout, strerror(e));
  }
  pthread_mutex_lock(&s->fd_lock);
  s->fd = fd;
  pthread_mutex_unlock(&s->fd_lock);
  if (atomic_load(&s->interrupted)) {
    drop_conn(s);
    return interrupted_error(s);
  }
  uint8_t g[GREETING];
  TP_CHECK(io_all(s, 0, g, GREETING, deadline, "waiting for the server's greeting"));
  if (memcmp(g, "TPCS", 4) != 0 || g[4] != STORE_VERSION) {
    drop_conn(s);
    return tp_set_error(TP_ERR_REMOTE, "%s: the server there is not a tpcore store of protocol version %u", s->where,
                        STORE_VERSION);
  }
  uint8_t hello[8 + HELLO_BODY];
  put_u64(hello, HELLO_BODY);
  hello[8] = OP_HELLO;
  if (!random_bytes(hello + 9, NONCE)) {
    drop_conn(s);
    return tp_set_error(TP_ERR_SYSTEM, "%s: getrandom: %s", s->where, strerror(errno));
  }
  hmac3(s->secret, s->secret_len, "tpcore-store-v1 client", g + 8, hello + 9, hello + 9 + NONCE);
  TP_CHECK(io_all(s, 1, hello, sizeof hello, deadline, "authenticating"));
  int status;
  uint8_t *p;
  size_t n;
  TP_CHECK(read_reply(s, deadline, "authenticating", &status, &p, &n));
  uint8_t want[MAC];
  hmac3(s->secret, s->secret_len, "tpcore-store-v1 server", hello + 9, g + 8, want);
  tp_status_t st = TP_SUCCESS;
  if (status == ST_ERR) st = tp_set_error(TP_ERR_INVALID_USAGE, "%s refused this client: %s", s->where, (char *)p);
  else if (status != ST_OK || n != MAC || !same_mac(want, p))
    st = tp_set_error(TP_ERR_INVALID_USAGE, "%s: the server does not know this job's secret (a different job's store "
                      "on this port, or TPCORE_STORE_SECRET differs between nodes)", s->where);
  free(p);
  if (st != TP_SUCCESS) drop_conn(s);
  return st;
}

/* Connects (again) when needed: a refused connection is retried until the deadline. */
static tp_status_t ensure_conn(tp_store_t s, double deadline) {
  if (s->fd >= 0) return TP_SUCCESS;
  for (;;) {
    if (atomic_load(&s->interrupted)) return interrupted_error(s);
    int refused;
    tp_status_t st = connect_once(s, deadline, &refused);
    if (st == TP_SUCCESS || !refused || tp_now() + 0.05 >= deadline) return st;
    usleep(50000);
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
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "store %s: a key must have 1..%d bytes, got %s", op,
                        TP_STORE_MAX_KEY, n ? "more" : "an empty key");
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
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "store open: the secret must have %d..%d bytes, got %zu (set "
                        "TPCORE_STORE_SECRET to the same random value on every node)", TP_STORE_MIN_SECRET,
                        TP_STORE_MAX_SECRET, cfg->secret ? cfg->secret_len : 0);
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
    st = server_start(cfg, host, ai, timeout, max_value, &s->server);
    if (st == TP_SUCCESS) {
      s->port = s->server->port;
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
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "store set('%s'): a value of %zu bytes is above max_value_bytes "
                        "(%zu)", key, nbytes, s->max_value);
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
    return tp_set_error(TP_ERR_INVALID_ARGUMENT, "store wait: %d keys take %zu bytes, above the message cap %zu",
                        nkeys, total, cap);
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
    return tp_set_error(TP_ERR_TIMEOUT, "store barrier('%s'): timed out after %g s with %" PRId64 " of %d "
                        "arrived (%s)", name, s->timeout, arrived, n, m);
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
  server_stop(s->server);
  s->server = NULL;
  pthread_mutex_destroy(&s->lock);
  pthread_mutex_destroy(&s->fd_lock);
  memset(s->secret, 0, sizeof s->secret);
  free(s);
}
