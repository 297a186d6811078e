/*
 * Private: the rendezvous store's wire protocol and the declarations its three files share:
 *   store_hmac.c    SHA-256, HMAC, constant-time compare, random bytes
 *   store_log.c     the server's rate-limited log
 *   store_server.c  the server (a thread of the process that opens the store with is_server)
 *   store.c         the client and the public tp_store_* API (tpcore/store.h)
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
#ifndef TPCORE_STORE_PROTO_H
#define TPCORE_STORE_PROTO_H

#include <netdb.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "../../core/core_impl.h"
#include "tpcore/store.h"

#define STORE_VERSION 1u
#define NONCE 32
#define MAC 32
#define GREETING (4 + 4 + NONCE)
#define HELLO_BODY (1 + NONCE + MAC)
#define MAX_ERR_TEXT 1024

enum { OP_HELLO = 1, OP_SET = 2, OP_GET = 3, OP_ADD = 4, OP_WAIT = 5, OP_DELETE = 6 };
enum { ST_OK = 0, ST_ERR = 1, ST_ABSENT = 2 };

/* ------------------------------------------------------------ little-endian fields */

static inline void put_u16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8); }
static inline void put_u64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint16_t get_u16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static inline uint64_t get_u64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
  return v;
}

/* The most a request body may be once authenticated: op, GET's flag, a key and its length,
 * a value; a WAIT of many keys fits in the same bound. */
static inline int max_request(size_t max_value, size_t *out) {
  return tp_add_size(max_value, 1 + 1 + 2 + TP_STORE_MAX_KEY + 8, out);
}

/* ------------------------------------------------------------ store_hmac.c */

/* HMAC-SHA256(key, label || a || b) with 32-byte a and b. */
void tp_store_hmac3(const uint8_t *key, size_t klen, const char *label, const uint8_t *a, const uint8_t *b,
                    uint8_t out[32]);
/* Whether two MACs are equal, in constant time. */
int tp_store_same_mac(const uint8_t *a, const uint8_t *b);
/* n bytes from getrandom(); 0 on failure (errno set). */
int tp_store_random_bytes(uint8_t *p, size_t n);

/* ------------------------------------------------------------ store_log.c */

/* The kinds of event the server logs, each rate-limited on its own. */
typedef enum {
  STORE_EV_EVICTED,  /* an unauthenticated connection dropped for a new one (slots full) */
  STORE_EV_FULL,     /* a connection refused: max_clients open */
  STORE_EV_AUTH,     /* a wrong secret */
  STORE_EV_PROTOCOL, /* a malformed, oversized or unknown message */
  STORE_EV_STALLED,  /* io_timeout passed inside a message, before the HELLO or a reply read */
  STORE_EV_CLOSED,   /* the client closed inside a message */
  STORE_EV_SYSTEM,   /* the server's own failures: memory, fds, getrandom */
  STORE_EV_KINDS
} store_event_t;

#define STORE_LOG_SUMMARY_S 10.0 /* the period of the summaries of what was not logged line by line */

typedef struct {
  int quiet; /* count, log nothing */
  double window_start;
  double last_line[STORE_EV_KINDS];
  int logged[STORE_EV_KINDS];
  unsigned long count[STORE_EV_KINDS];      /* events of the summary window */
  unsigned long suppressed[STORE_EV_KINDS]; /* of those, not logged line by line */
} store_log_t;

/* One event: logged as "tpcore store <where>: <fmt...>" when no line of its kind was logged
 * in the last second, else counted for the summary. */
void tp_store_vlog(store_log_t *lg, const char *where, store_event_t kind, double now, const char *fmt, va_list ap);
/* The summaries, when STORE_LOG_SUMMARY_S has passed since the last ones (final: now). */
void tp_store_log_flush(store_log_t *lg, const char *where, double now, int final);

/* ------------------------------------------------------------ store_server.c */

typedef struct tp_store_server server_t;

/* Binds (ai), listens and starts the server's thread; *out on success. */
tp_status_t tp_store_server_start(const tp_store_config_t *cfg, const char *host, const struct addrinfo *ai,
                                  double timeout, size_t max_value, server_t **out);
/* The port it listens on (the bound one when cfg->port was 0). */
int tp_store_server_port(const server_t *sv);
/* Stops the thread (the replies already due go out) and frees it; NULL is a no-op. */
void tp_store_server_stop(server_t *sv);

#endif
