/*
 * shim_store.c - a tiny client of torch.distributed's TCPStore wire protocol
 * (torch/csrc/distributed/c10d/TCPStore.cpp, TCPStoreBackend.hpp; the libuv
 * backend speaks the same protocol). Enough for the recovery rendezvous of
 * shim_transparent.c in a process with no Python in it.
 *
 * Wire format (host byte order, as torch's sendValue/recvValue use it):
 *   connect, then VALIDATE: u8 QueryType::VALIDATE(0), u32 0x3C85F7CE (no reply)
 *   string/bytes: u64 length, then the bytes; keys carry the client's
 *     keyPrefix_ "/" (a Python client's key "a/b" is "/a/b" on the wire)
 *   SET(1):    key, value                      -> (no reply)
 *   GET(3):    key                             -> bytes   (only after CHECK says ready)
 *   ADD(4):    key, i64 delta                  -> i64 new value (key created at 0)
 *   CHECK(5):  u64 nkeys, keys                 -> u8 READY(0) | NOT_READY(1)
 * One connection per process, guarded by st_mu; every call has a deadline
 * (SO_RCVTIMEO/SO_SNDTIMEO), and a broken connection is re-opened once.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "shim_base.h"

enum { Q_VALIDATE = 0, Q_SET = 1, Q_COMPARE_SET = 2, Q_GET = 3, Q_ADD = 4, Q_CHECK = 5 };
#define MAGIC 0x3C85F7CEu

static pthread_mutex_t st_mu = PTHREAD_MUTEX_INITIALIZER;
static int st_fd = -1;

static void set_timeout(int fd, double s) {
  struct timeval tv = {(time_t)s, (suseconds_t)((s - (double)(time_t)s) * 1e6)};
  if (tv.tv_sec == 0 && tv.tv_usec == 0) tv.tv_usec = 1000;
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

static int send_all(int fd, const void *p, size_t n) {
  const char *b = p;
  while (n) {
    ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    b += w, n -= (size_t)w;
  }
  return 0;
}
static int recv_all(int fd, void *p, size_t n) {
  char *b = p;
  while (n) {
    ssize_t r = recv(fd, b, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    b += r, n -= (size_t)r;
  }
  return 0;
}

/* Request buffer: one send per request. */
struct req {
  unsigned char b[1024];
  size_t n;
  int bad;
};
static void put(struct req *q, const void *p, size_t n) {
  if (q->n + n > sizeof q->b) { q->bad = 1; return; }
  memcpy(q->b + q->n, p, n);
  q->n += n;
}
static void put_u8(struct req *q, uint8_t v) { put(q, &v, 1); }
static void put_u64(struct req *q, uint64_t v) { put(q, &v, 8); }
static void put_str(struct req *q, const void *s, size_t n) { put_u64(q, n), put(q, s, n); }
/* torch's client sends every key as keyPrefix_ ("/") + key; doing the same
 * makes our keys the ones a Python TCPStore client reads and writes. */
static void put_key(struct req *q, const char *k) {
  size_t n = strlen(k);
  put_u64(q, n + 1);
  put(q, "/", 1);
  put(q, k, n);
}

static int open_conn(double timeout_s) {
  const char *host = ji_getenv("MASTER_ADDR"), *port = ji_getenv("MASTER_PORT");
  if (!host || !port) return -1;
  struct addrinfo hints, *res = NULL;
  memset(&hints, 0, sizeof hints);
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(host, port, &hints, &res) != 0 || !res) return -1;
  double end = ji_now() + timeout_s;
  int fd = -1;
  do {
    for (struct addrinfo *a = res; a && fd < 0; a = a->ai_next) {
      fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      set_timeout(fd, timeout_s);
      if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) close(fd), fd = -1;
    }
    if (fd < 0) usleep(20000);
  } while (fd < 0 && ji_now() < end);
  freeaddrinfo(res);
  if (fd < 0) return -1;
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  struct req q = {.n = 0};
  uint32_t magic = MAGIC;
  put_u8(&q, Q_VALIDATE);
  put(&q, &magic, 4);
  if (send_all(fd, q.b, q.n)) {
    close(fd);
    return -1;
  }
  return fd;
}

/* Sends q and reads `rn` reply bytes into r (rn may be 0). Caller holds st_mu. */
static int roundtrip(struct req *q, void *r, size_t rn, double timeout_s) {
  if (q->bad) return -1;
  for (int attempt = 0; attempt < 2; attempt++) {
    if (st_fd < 0) st_fd = open_conn(timeout_s);
    if (st_fd < 0) return -1;
    set_timeout(st_fd, timeout_s);
    if (send_all(st_fd, q->b, q->n) == 0 && (rn == 0 || recv_all(st_fd, r, rn) == 0)) return 0;
    close(st_fd);
    st_fd = -1;
  }
  return -1;
}

int ji_store_available(void) { return ji_getenv("MASTER_ADDR") && ji_getenv("MASTER_PORT"); }

int ji_store_set(const char *key, const void *val, size_t n, double timeout_s) {
  struct req q = {.n = 0};
  put_u8(&q, Q_SET);
  put_key(&q, key);
  put_str(&q, val, n);
  pthread_mutex_lock(&st_mu);
  int rc = roundtrip(&q, NULL, 0, timeout_s);
  pthread_mutex_unlock(&st_mu);
  return rc;
}

int ji_store_add(const char *key, int64_t delta, int64_t *out, double timeout_s) {
  struct req q = {.n = 0};
  put_u8(&q, Q_ADD);
  put_key(&q, key);
  put(&q, &delta, 8);
  int64_t v = 0;
  pthread_mutex_lock(&st_mu);
  int rc = roundtrip(&q, &v, 8, timeout_s);
  pthread_mutex_unlock(&st_mu);
  if (rc == 0 && out) *out = v;
  return rc;
}

/* 1 present, 0 absent, -1 error. */
int ji_store_check(const char *key, double timeout_s) {
  struct req q = {.n = 0};
  put_u8(&q, Q_CHECK);
  put_u64(&q, 1);
  put_key(&q, key);
  uint8_t r = 1;
  pthread_mutex_lock(&st_mu);
  int rc = roundtrip(&q, &r, 1, timeout_s);
  pthread_mutex_unlock(&st_mu);
  return rc ? -1 : r == 0;
}

/* Reads a value of exactly n bytes (the key must exist: CHECK first). */
int ji_store_get(const char *key, void *val, size_t n, double timeout_s) {
  struct req q = {.n = 0};
  put_u8(&q, Q_GET);
  put_key(&q, key);
  uint64_t len = 0;
  int rc = -1;
  pthread_mutex_lock(&st_mu);
  if (roundtrip(&q, &len, 8, timeout_s) == 0) {
    if (len == n && recv_all(st_fd, val, n) == 0) {
      rc = 0;
    } else { /* unexpected size: the stream is out of step, drop it */
      close(st_fd);
      st_fd = -1;
    }
  }
  pthread_mutex_unlock(&st_mu);
  return rc;
}

/* Forked children must not share the parent's connection. */
void ji_store_atfork_child(void) {
  pthread_mutex_init(&st_mu, NULL);
  st_fd = -1;
}

/* Before a CRIU dump of this process: no socket may cross to another node
 * (the next request reconnects, from wherever the process then runs). */
void ji_store_close(void) {
  pthread_mutex_lock(&st_mu);
  if (st_fd >= 0) close(st_fd);
  st_fd = -1;
  pthread_mutex_unlock(&st_mu);
}
