/*
 * shim_device.c - a rank whose device is lost while its process lives
 * (paper §4.3, with §4.2.2 for the optimizer phase):
 * JITCKPT_ON_HANG=recover plus JITCKPT_ON_DEVICE_LOSS=migrate.
 *
 * The recovery epoch (shim_transparent.c) runs as for a transient fault; the
 * rank that saw a sticky CUDA error additionally, between announcing the
 * epoch and joining it:
 *   1. gives the device up (no device memory goes into a CPU checkpoint) and
 *      closes its store connection (no socket may cross to another node);
 *   2. writes JITCKPT_DEVICE_DIR/device-lost-<rank>-<epoch>.json and waits,
 *      polling with no fd open, for device-resume-<rank>-<epoch>.json. Meanwhile
 *      whoever drives migration (launcher/migration/device_loss.py) dumps the process
 *      with CRIU, restores it where a healthy device is, and writes the resume
 *      file there with the new device's identity, or ({"fallback": why}) tells
 *      it nobody will, and the epoch falls back at once instead of at the bound;
 *   3. attaches the new device and re-makes every live allocation at the
 *      address the application holds (on the stand-in jitsimMallocAt; on a GPU
 *      that would be cuMemAddressReserve at the old address + cuMemCreate/Map,
 *      not implemented: such a rank falls back), and the shim's own stream and events.
 * After every rank joined and the communicators are new, all ranks read who
 * lost its device and where each stands (minibatch, optimizer phase), and
 * decide alike: the lowest healthy rank is the donor; it sends every live
 * allocation to each lost rank, matched by name (allocating call stack, its
 * sequence number, size), over the new communicator. Then either the lost
 * rank replays its minibatch like everybody (fault before the optimizer: the
 * replicas wait in that minibatch's collectives, parameters untouched), or,
 * when it faulted in the optimizer step after the replicas completed theirs
 * (they wait in the next minibatch), it takes their post-update state and
 * drops its device calls until the next minibatch_begin. Any other
 * combination has no replica at a minibatch boundary: every rank falls back.
 *
 * Threads: everything here runs on the recovery's coordinator thread with the
 * gate up; the flags are atomics read by hooks on any thread.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "jitintercept.h"
#include "shim_recovery.h"

int ji_dev_mode;
_Atomic int ji_dev_lost;

__attribute__((constructor)) static void dev_init(void) {
  const char *m = ji_getenv("JITCKPT_ON_DEVICE_LOSS");
  const char *h = ji_getenv("JITCKPT_ON_HANG");
  ji_dev_mode = m && !strcmp(m, "migrate") && h && !strcmp(h, "recover");
}

/* ---------------- allocation names ---------------- */
static uint64_t fnv(const void *p, size_t n, uint64_t h) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

/* The application's call stack above the shim, as (object basename, offset)
 * pairs: equal in every process of the same binaries whatever ASLR chose. */
uint64_t ji_callsite(void) {
  if (!ji_dev_mode) return 0; /* names are only needed for a device swap */
  void *fr[12];
  int n = backtrace(fr, 12);
  Dl_info self;
  if (!dladdr((void *)ji_callsite, &self)) self.dli_fbase = NULL;
  uint64_t h = 1469598103934665603ull;
  for (int i = 0; i < n; i++) {
    Dl_info d;
    if (!dladdr(fr[i], &d) || !d.dli_fname) {
      h = fnv("?", 1, h);
      continue;
    }
    if (d.dli_fbase == self.dli_fbase) continue; /* shim frames */
    const char *base = strrchr(d.dli_fname, '/');
    base = base ? base + 1 : d.dli_fname;
    uint64_t off = (uint64_t)((const char *)fr[i] - (const char *)d.dli_fbase);
    h = fnv(base, strlen(base), h);
    h = fnv(&off, sizeof off, h);
  }
  return h;
}

uint64_t ji_dev_digest(void) {
  ji_alloc_key *k;
  size_t n = ji_alloc_keys(&k);
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) {
    h = fnv(&k[i].site, sizeof k[i].site, h);
    h = fnv(&k[i].seq, sizeof k[i].seq, h);
    uint64_t sz = k[i].n;
    h = fnv(&sz, sizeof sz, h);
  }
  free(k);
  return h;
}

/* ---------------- the device swap ---------------- */
static void *sim_sym(const char *name) {
  void *p = dlsym(RTLD_DEFAULT, name);
  return p ? p : ji_sym_in_lib(JI_CUDART, name);
}

const char *ji_dev_precheck(void) {
  const char *dir = ji_getenv("JITCKPT_DEVICE_DIR");
  if (!dir || !*dir) return "device lost and JITCKPT_DEVICE_DIR is not set: nobody can move this process to a new device";
  if (!sim_sym("jitsimDeviceReplace") || !sim_sym("jitsimMallocAt") || !sim_sym("jitsimDeviceDetach"))
    return "device lost: this CUDA runtime cannot attach a new device to a live process with allocations at "
           "their old addresses (the stand-in can; on a GPU this needs the driver's VMM calls, not implemented)";
  if ((ji_vh_mode & (JI_VM_STREAMS | JI_VM_EVENTS | JI_VM_COMMS)) != (JI_VM_STREAMS | JI_VM_EVENTS | JI_VM_COMMS))
    return "device lost: the application holds physical stream/event handles of the old device "
           "(JITCKPT_VIRTUAL_HANDLES=all is needed to move it to a new one)";
  return NULL;
}

static double wall(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int write_atomic(const char *path, const char *text) {
  char tmp[4300];
  if (snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid()) >= (int)sizeof tmp) return -1;
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return -1;
  size_t n = strlen(text);
  int ok = write(fd, text, n) == (ssize_t)n && fsync(fd) == 0;
  close(fd);
  if (!ok || rename(tmp, path)) {
    unlink(tmp);
    return -1;
  }
  return 0;
}

/* The resume file's "uuid" value (1), or its "fallback" reason (2: nobody will
 * move this process; out holds the reason); 0 while there is none. No fd stays open. */
static int read_resume(const char *path, char *out, size_t n) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  char buf[1024];
  ssize_t k = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (k <= 0) return 0;
  buf[k] = 0;
  int kind = 1;
  char *p = strstr(buf, "\"uuid\"");
  if (!p) {
    p = strstr(buf, "\"fallback\"");
    kind = 2;
  }
  if (!p || !(p = strchr(p + (kind == 1 ? 6 : 10), ':')) || !(p = strchr(p, '"'))) return 0;
  char *e = strchr(++p, '"');
  if (!e || e == p) return 0;
  size_t len = (size_t)(e - p);
  if (kind == 1 && len >= 64) return 0; /* a device name is short and never cut */
  if (len >= n) {
    len = n - 1; /* a reason may be cut short */
  }
  memcpy(out, p, len);
  out[len] = 0;
  return kind;
}

static const char *park_and_replace(int rank, int epoch, double bound_s, const char *old);

const char *ji_dev_park_and_replace(int rank, int epoch, double bound_s) {
  cudaError_t (*detach)(void) = (cudaError_t(*)(void))sim_sym("jitsimDeviceDetach");
  const char *(*uuid_of)(void) = (const char *(*)(void))sim_sym("jitsimDeviceUuid");
  char old[64];
  snprintf(old, sizeof old, "%s", uuid_of ? uuid_of() : "?");
  ji_tls.depth++;
  detach();
  ji_tls.depth--;
  ji_store_close();
  /* A parent-death signal (jitrun's migratable wrapper sets one) is per thread and
   * survives the dump; the restorer keeps it harmless by making the restored
   * process its own child (launcher/criu.py restore(as_child=True)). */
  return park_and_replace(rank, epoch, bound_s, old);
}

static const char *park_and_replace(int rank, int epoch, double bound_s, const char *old) {
  cudaError_t (*replace)(const char *) = (cudaError_t(*)(const char *))sim_sym("jitsimDeviceReplace");
  cudaError_t (*malloc_at)(void *, size_t) = (cudaError_t(*)(void *, size_t))sim_sym("jitsimMallocAt");
  const char *dir = ji_getenv("JITCKPT_DEVICE_DIR");
  char lost[4200], resume[4200], text[512];
  snprintf(lost, sizeof lost, "%s/device-lost-%d-%d.json", dir, rank, epoch);
  snprintf(resume, sizeof resume, "%s/device-resume-%d-%d.json", dir, rank, epoch);
  snprintf(text, sizeof text, "{\"rank\": %d, \"pid\": %d, \"epoch\": %d, \"device\": \"%s\", \"t\": %.6f}\n", rank,
           (int)getpid(), epoch, old, wall());
  if (write_atomic(lost, text)) return "device lost: cannot write the request file in JITCKPT_DEVICE_DIR";
  char json[700];
  snprintf(json, sizeof json,
           "{\"event\": \"shim_device_lost\", \"t\": %.6f, \"rank\": %d, \"pid\": %d, \"epoch\": %d, \"device\": \"%s\"}",
           wall(), rank, (int)getpid(), epoch, old);
  ji_event_write(json);

  /* Wall clock: CLOCK_MONOTONIC does not carry over to another machine. */
  char uuid[64];
  static char refused[200]; /* only this (the recovering) thread gets here */
  double parked = wall(), end = parked + bound_s;
  int got;
  while (!(got = read_resume(resume, refused, sizeof refused))) {
    if (wall() > end) return "device lost: no new device within JITCKPT_RECOVER_TIMEOUT (was the process moved?)";
    usleep(20000);
  }
  if (got == 2) return refused;
  memcpy(uuid, refused, sizeof uuid); /* read_resume: a uuid is under 64 bytes */
  uuid[sizeof uuid - 1] = 0;
  ji_tls.depth++;
  cudaError_t r = replace(uuid);
  ji_tls.depth--;
  if (r != cudaSuccess) return "device lost: attaching the new device failed";
  ji_alloc_key *k;
  size_t n = ji_alloc_keys(&k);
  const char *why = NULL;
  ji_tls.depth++;
  for (size_t i = 0; i < n && !why; i++)
    if (malloc_at(k[i].p, k[i].n) != cudaSuccess) why = "device lost: an allocation could not be re-made at its old address";
  ji_tls.depth--;
  free(k);
  if (why) return why;
  ji_pool_device_replaced();
  snprintf(json, sizeof json,
           "{\"event\": \"shim_device_replaced\", \"t\": %.6f, \"rank\": %d, \"pid\": %d, \"epoch\": %d, "
           "\"device\": \"%s\", \"old_device\": \"%s\", \"allocations\": %zu, \"parked_s\": %.6f}",
           wall(), rank, (int)getpid(), epoch, uuid, old, n, wall() - parked);
  ji_event_write(json);
  return NULL;
}

/* The donor sends every live allocation to each lost rank, in name order; both
 * sides checked before that their names agree (ji_dev_digest). */
const char *ji_dev_refill(void *comm, int me, int donor, const int *lost, int nlost, double deadline) {
  (void)deadline;
  ji_fn_ncclSend snd = REAL(ncclSend);
  ji_fn_ncclRecv rcv = REAL(ncclRecv);
  ji_fn_cudaStreamSynchronize sync = REAL(cudaStreamSynchronize);
  cudaStream_t s = ji_private_stream();
  if (!snd || !rcv || !sync || !s) return "refill: ncclSend/ncclRecv or the private stream is missing";
  ji_alloc_key *k;
  size_t n = ji_alloc_keys(&k);
  const char *why = NULL;
  ji_tls.depth++;
  for (int j = 0; j < nlost && !why; j++) {
    if (me != donor && me != lost[j]) continue;
    for (size_t i = 0; i < n && !why; i++) {
      ncclResult_t r = me == donor ? snd(k[i].p, k[i].n, ncclUint8, lost[j], (ncclComm_t)comm, s)
                                   : rcv(k[i].p, k[i].n, ncclUint8, donor, (ncclComm_t)comm, s);
      if (r != ncclSuccess) why = "refill: a transfer from the replica failed";
    }
  }
  if (!why && (me == donor || n) && sync(s) != cudaSuccess) why = "refill: the transfers did not complete";
  ji_tls.depth--;
  free(k);
  return why;
}

/* A digest of every live allocation's name and bytes, in name order. A refill
 * copies the donor's allocations, so afterwards its receiver must hash to the
 * donor's value: what the replicas compare before the replay (a transfer
 * corrupted on the way, an allocation refilled from the wrong one). Words at a
 * time: it reads the whole device state once per refill. */
static uint64_t mix(const unsigned char *b, size_t n, uint64_t h) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    memcpy(&w, b + i, 8);
    h = (h ^ w) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
  }
  return fnv(b + i, n - i, h);
}

const char *ji_dev_state_digest(uint64_t *out) {
  enum { CHUNK = 1 << 20 };
  ji_fn_cudaMemcpy cp = REAL(cudaMemcpy);
  if (!cp) return "refill check: cudaMemcpy is missing";
  unsigned char *buf = malloc(CHUNK);
  if (!buf) return "refill check: out of host memory";
  ji_alloc_key *k;
  size_t n = ji_alloc_keys(&k);
  uint64_t h = 1469598103934665603ull;
  const char *why = NULL;
  ji_tls.depth++;
  for (size_t i = 0; i < n && !why; i++) {
    h = fnv(&k[i].site, sizeof k[i].site, h);
    h = fnv(&k[i].seq, sizeof k[i].seq, h);
    for (size_t off = 0; off < k[i].n && !why; off += CHUNK) {
      size_t len = k[i].n - off < CHUNK ? k[i].n - off : CHUNK;
      if (cp(buf, (const char *)k[i].p + off, len, cudaMemcpyDeviceToHost) != cudaSuccess)
        why = "refill check: reading the device state back failed";
      else
        h = mix(buf, len, h);
    }
  }
  ji_tls.depth--;
  free(k);
  free(buf);
  *out = h;
  return why;
}
