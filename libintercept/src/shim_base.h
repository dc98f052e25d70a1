/*
 * shim_base.h - declarations of the shim's lowest layer, shared by every
 * translation unit. The shim's internal headers are one per layer, each
 * including the one below it, lowest first:
 *   shim_base.h      base      core, vh, store, gil, pool, comms, trigger, watchlist
 *   shim_replay.h    replay    replay
 *   shim_recovery.h  recovery  device, recover, transparent
 *   shim_watchdog.h  watchdog  watchdog
 *   shim_entry.h     entry     phases, cuda, nccl, v12 (the application's calls;
 *                              the hooks' hot-path inline functions)
 * A module includes the header of its own layer and calls only modules of its
 * own layer listed before it, or of a lower layer (entry modules call each
 * other): the watchdog calls the recovery, the recovery the replay, never the
 * other way. scripts/check_shim_layers.py checks the calls on the object
 * files and the #include lines on the sources.
 */
#ifndef JI_SHIM_BASE_H
#define JI_SHIM_BASE_H

#include <stdatomic.h>
#include <stdint.h>
#include <stddef.h>
#include <signal.h>

#include "cuda_abi.h"
#include "nccl_abi.h"
#include "shim_table.h"

/* Everything declared below lives in this library: without this, -fvisibility
 * =hidden leaves the extern declarations default, and every access to a
 * global on the hot path goes through the GOT (a load of its address, then
 * the load of the value) instead of one %rip-relative load. */
#pragma GCC visibility push(hidden)

#define JI_API __attribute__((visibility("default")))
#define JI_HIDDEN __attribute__((visibility("hidden")))
#define JI_LIKELY(x) __builtin_expect(!!(x), 1)
#define JI_UNLIKELY(x) __builtin_expect(!!(x), 0)
/* Static TLS: the shim is preloaded, so initial-exec is valid and keeps each
 * thread-local access a single %fs-relative load on the hot path. */
#define JI_TLS __thread __attribute__((tls_model("initial-exec")))

/* ---- real symbols, counters, environment, statistics (shim_core.c) ---- */
/* The globals every hook reads, each written rarely (at start-up, once per
 * minibatch, when a recovery starts or ends; their writers are named in the
 * sections below): one cache line of their own, so a hook touches one line
 * for all of them and no frequently written neighbour (a group count, a poll
 * time) takes that line away from the threads that read it. */
typedef struct {
  uintptr_t vh_base;     /* virtual-handle arena, or JI_VH_NONE (shim_vh.c) */
  _Atomic int pm_used;   /* a shadow record exists (shim_vh.c) */
  _Atomic int log_armed; /* replay log armed (shim_replay.c) */
  _Atomic int rcv_attn;  /* the hooks' slow-path gate (shim_transparent.c) */
  _Atomic int discard;   /* drop device calls (shim_device.c) */
} __attribute__((aligned(64))) ji_hot_t;
extern ji_hot_t ji_hot;

#define JI_FNTYPE_(name, ret, params, args, lib, flags) typedef ret(*ji_fn_##name) params;
JI_TABLE(JI_FNTYPE_)
#undef JI_FNTYPE_

extern _Atomic(void *) ji_real_fns[JI_N_SYMS];
extern const char *const ji_names[JI_N_SYMS];
extern const unsigned ji_flags[JI_N_SYMS];

JI_HIDDEN void *ji_resolve(int id);
/* Pointer to the real function, or NULL when the library is not loaded. */
static inline void *ji_real(int id) {
  void *p = atomic_load_explicit(&ji_real_fns[id], memory_order_relaxed);
  return JI_LIKELY(p != NULL) ? p : ji_resolve(id);
}
#define REAL(name) ((ji_fn_##name)ji_real(JI_ID_##name))

/* Per-thread counter blocks: the owning thread increments without a locked
 * instruction (relaxed load + store on memory only it writes); readers sum
 * all blocks with relaxed loads. Blocks live until exit (few threads call
 * CUDA), so a reader never sees freed memory. */
typedef struct ji_cblock {
  _Atomic uint64_t c[JI_N_SYMS];
  struct ji_cblock *next;
} ji_cblock;
JI_HIDDEN ji_cblock *ji_cblock_new(void);

/* Everything a hook reads about its own thread, in one thread-local block:
 * one TLS offset per hook, every field %fs-relative. */
typedef struct ji_thread {
  /* Depth of shim frames on this thread: calls the runtime makes into other
   * hooked entry points while serving our call (the stand-in's libnccl
   * calling libcudart through the PLT, for example) must pass straight
   * through, or they would be logged and counted twice and see physical
   * handles as foreign. */
  int depth;
  /* Set while this thread runs the hang handler (the trigger thread). */
  int trigger;
  /* Replay-log pause (jitintercept_log_suspend, the handler). */
  int log_off;
  /* Set by a hook's failed call after a lost-device recovery in replay mode:
   * the record the hook logs next is executed at its commit (ji_rcv_reissue). */
  int reissue;
  /* Set between ji_rcv_begin and ji_rcv_after_block: a blocking hook redoes
   * a call that met a lost device itself (no re-issue from the log). */
  int in_block;
  ji_cblock *cnt;
} __attribute__((aligned(32))) ji_thread;
_Static_assert(sizeof(ji_thread) == 32, "the thread block must stay within one cache line");
extern JI_TLS ji_thread ji_tls;

JI_HIDDEN double ji_now(void);
JI_HIDDEN const char *ji_getenv(const char *name);
/* A non-negative number from the environment, or dflt. */
JI_HIDDEN double ji_env_num(const char *name, double dflt);
JI_HIDDEN void *ji_sym_in_lib(int lib, const char *name);

/* Statistics by name (jitintercept_stat). */
enum { JI_ST_REDIRECTS, JI_ST_TRIGGERS, JI_ST_GIL_SIGNALS, JI_ST_GIL_RELEASED, JI_ST_WATCHED,
       JI_ST_COMPLETED, JI_ST_OVERFLOW_TOTAL, JI_ST_N };
extern _Atomic uint64_t ji_stats[JI_ST_N];

/* Errors after which the context is unusable (cudaErrorIllegalAddress and
 * its family: launch failure, illegal instruction, misaligned address, ...). */
static inline int ji_sticky_cuda(int rc) { return rc == 700 || (rc >= 714 && rc <= 719) || rc == 999; }

/* ---- virtual handles (shim_vh.c) ---- */
enum { JI_VK_STREAM = 1, JI_VK_EVENT = 2, JI_VK_COMM = 3 };
#define JI_VH_NCCL 1u /* stream carries NCCL work */

struct ji_comm_info;
typedef struct ji_vh {
  _Atomic(void *) phys;
  uint16_t kind;
  uint16_t shadow; /* 1: the application holds the physical handle (not virtualized) */
  _Atomic uint32_t gen;
  uint32_t cflags; /* creation flags (stream / event) */
  int32_t prio;
  _Atomic uint32_t sflags;            /* stream: JI_VH_NCCL */
  _Atomic uint32_t last_coll;         /* stream: id of the last collective */
  _Atomic(void *) rec_stream;         /* event: app stream handle of the last record */
  _Atomic uint64_t rec_seq;           /* event: bumped on every record */
  struct ji_comm_info *comm;          /* comm: creation record; free-list link */
} ji_vh;
_Static_assert(sizeof(ji_vh) <= 64, "virtual handle slot must stay one line");

#define JI_VH_SLOT 64u
#define JI_VH_MAX (1u << 20)
#define JI_VH_SPAN ((uintptr_t)JI_VH_SLOT * JI_VH_MAX)
/* ji_hot.vh_base before the arena is mapped (or when it cannot be): the top of
 * the address space, where no handle of the application's can lie (a base of
 * 0 would make NULL and the small stream constants look virtual), so the
 * hooks' range check needs no "is there an arena" test. */
#define JI_VH_NONE ((uintptr_t)0 - JI_VH_SPAN)
/* One test for "inside the arena and on a slot boundary": the offset has no
 * bit above the arena's span and none below a slot. Never true for NULL. */
#define JI_VH_MASK (~(JI_VH_SPAN - 1) | (JI_VH_SLOT - 1))
static inline int ji_is_vh(const void *h) { return (((uintptr_t)h - ji_hot.vh_base) & JI_VH_MASK) == 0; }
static inline ji_vh *ji_vh_of(const void *h) { return ji_is_vh(h) ? (ji_vh *)h : NULL; }
/* Physical handle for a virtual one; anything else (0, legacy/per-thread
 * stream constants, handles created behind our back) passes unchanged. */
static inline void *ji_phys(const void *h) {
  return ji_is_vh(h) ? atomic_load_explicit(&((ji_vh *)h)->phys, memory_order_acquire) : (void *)h;
}

/* Which kinds the application gets virtual handles for (JITCKPT_VIRTUAL_HANDLES).
 * Objects of the other kinds still get a slot (a "shadow" record holding the
 * same bookkeeping), found from the physical handle through a hash map. */
enum { JI_VM_STREAMS = 1, JI_VM_EVENTS = 2, JI_VM_COMMS = 4 };
extern int ji_vh_mode;
/* physical handle -> shadow record: open addressing, pointer keys, linear
 * probing (shim_vh.c). Readers are lock-free: acquire load of the key, value
 * stored before the key is published. */
#define JI_PM_CAP (1u << 16)
#define JI_PM_PROBE 64
/* Key and value side by side: a probe reads one cache line, not two. */
typedef struct {
  _Atomic(void *) key;
  _Atomic(ji_vh *) val;
} ji_pm_ent;
extern ji_pm_ent ji_pm[JI_PM_CAP];
static inline size_t ji_pm_hash(const void *p) { return (size_t)(((uintptr_t)p >> 4) * 0x9E3779B97F4A7C15ull >> 48); }
static inline ji_vh *ji_pm_get(const void *phys) {
  if (!phys) return NULL;
  size_t h = ji_pm_hash(phys);
  for (unsigned i = 0; i < JI_PM_PROBE; i++) {
    size_t s = (h + i) & (JI_PM_CAP - 1);
    void *k = atomic_load_explicit(&ji_pm[s].key, memory_order_acquire);
    if (JI_LIKELY(k == phys)) return atomic_load_explicit(&ji_pm[s].val, memory_order_relaxed);
    if (!k) return NULL;
  }
  return NULL;
}
/* Record for an application handle, virtual or physical; NULL if unknown. */
static inline ji_vh *ji_slot(const void *h) {
  if (ji_is_vh(h)) return (ji_vh *)h;
  return atomic_load_explicit(&ji_hot.pm_used, memory_order_relaxed) ? ji_pm_get(h) : NULL;
}
/* The handle the application is given for a record. */
static inline void *ji_vh_app(ji_vh *v) { return v->shadow ? atomic_load(&v->phys) : (void *)v; }
JI_HIDDEN ji_vh *ji_vh_alloc(uint32_t kind, void *phys);
JI_HIDDEN void ji_vh_free(ji_vh *v);
JI_HIDDEN void ji_vh_foreach(uint32_t kind, void (*fn)(ji_vh *, void *), void *arg);

struct ji_comm_info {
  int nranks, rank;
  ncclUniqueId id;
  int has_config;
  ncclConfig_t config;
  ji_vh *parent; /* non-NULL for ncclCommSplit children */
  int color, key;
};

/* NCCL streams: a stream record's JI_VH_NCCL flag, and a small list for
 * streams that have no record (stream 0, per-thread, created before the shim). */
JI_HIDDEN void ji_mark_nccl_stream(cudaStream_t vstream, int coll_id);
extern _Atomic int ji_nv_n;
JI_HIDDEN int ji_is_nv_stream(cudaStream_t s);
static inline int ji_is_nccl_stream(cudaStream_t s) {
  ji_vh *v = ji_slot(s);
  if (v) return (atomic_load_explicit(&v->sflags, memory_order_relaxed) & JI_VH_NCCL) != 0;
  return atomic_load_explicit(&ji_nv_n, memory_order_relaxed) && ji_is_nv_stream(s);
}
JI_HIDDEN void ji_nccl_nv_streams(void **out, int *n, int max);
JI_HIDDEN void ji_vh_foreach_all(uint32_t kind, void (*fn)(ji_vh *, void *), void *arg);

/* ---- TCPStore client (shim_store.c) ---- */
JI_HIDDEN int ji_store_available(void);
JI_HIDDEN int ji_store_set(const char *key, const void *val, size_t n, double timeout_s);
JI_HIDDEN int ji_store_add(const char *key, int64_t delta, int64_t *out, double timeout_s);
JI_HIDDEN int ji_store_check(const char *key, double timeout_s);
JI_HIDDEN int ji_store_get(const char *key, void *val, size_t n, double timeout_s);
JI_HIDDEN void ji_store_atfork_child(void);
JI_HIDDEN void ji_store_close(void);

/* ---- parking and the GIL (shim_gil.c) ----
 * Blocking-call bracket: marks this thread parked in the runtime so the
 * watchdog may ask it, by signal, to release the GIL. */
JI_HIDDEN void ji_park_enter(void);
JI_HIDDEN void ji_park_exit(void);
JI_HIDDEN int ji_gil_release_parked(double wait_s);

/* ---- the shim's own stream and events; draining (shim_pool.c) ---- */
JI_HIDDEN cudaStream_t ji_private_stream(void);
JI_HIDDEN void ji_private_stream_make(void);
JI_HIDDEN void *ji_pool_get(void);
JI_HIDDEN void ji_pool_put(void *e);
JI_HIDDEN void ji_pool_device_replaced(void);
JI_HIDDEN void ji_pool_atfork_child(void);
/* Records an event on every stream and polls them until done or the
 * deadline. 0: drained; -1: timeout; >0: CUDA error. */
JI_HIDDEN int ji_drain_streams(double deadline);

/* ---- live communicators (shim_comms.c) ---- */
JI_HIDDEN void ji_comms_add(ji_vh *vc);
JI_HIDDEN void ji_comms_remove(ji_vh *vc);
JI_HIDDEN int ji_comms_async_error(int *rank);
JI_HIDDEN void ji_comms_abort_all(void);
JI_HIDDEN int ji_comms_device(void);
/* Rank label: the communicator's rank, else RANK, else -1. */
JI_HIDDEN int ji_comm_rank(const ji_vh *vc);
JI_HIDDEN void ji_comms_atfork_child(void);

/* ---- the trigger: handler, event line, latch, exit (shim_trigger.c) ---- */
extern _Atomic int ji_trigger_active;
extern int ji_redirect_enabled;
JI_HIDDEN void ji_trigger_configure(void);
JI_HIDDEN int ji_trigger_claim(void);
JI_HIDDEN int ji_trigger_fired(void);
JI_HIDDEN void ji_trigger_release(void);
JI_HIDDEN void ji_event_write(const char *json);
JI_HIDDEN void ji_trigger_fire(const char *json);
JI_HIDDEN void ji_trigger_exit(void) __attribute__((noreturn));
JI_HIDDEN void ji_trigger_fallback(void) __attribute__((noreturn));

/* ---- what is watched, and for how long (shim_watchlist.c) ---- */
typedef struct ji_watch {
  struct ji_watch *next;
  void *pev;        /* physical event polled */
  int own;          /* pooled event: back to the pool when done */
  ji_vh *vev;       /* application event (own == 0) */
  uint32_t gen;
  uint64_t rec_seq;
  void *skey;       /* application stream handle: per-stream FIFO key */
  int coll;         /* JI_ID_* of the (last) collective */
  int rank;
  uint64_t seq;
  double t_enq, t_start;
} ji_watch;
JI_HIDDEN void ji_watch_configure(void);
JI_HIDDEN double ji_watch_timeout(void);
JI_HIDDEN void ji_watch_completed(double seconds);
JI_HIDDEN void ji_watch_collective(int id, cudaStream_t vstream, ji_vh *vcomm);
JI_HIDDEN void ji_watch_group_start(void);
JI_HIDDEN void ji_watch_group_end(int ok);
JI_HIDDEN int ji_watch_group_depth(void);
JI_HIDDEN void ji_watch_stream_wait(cudaStream_t vstream, ji_vh *vev);
JI_HIDDEN void ji_watch_reset(void);
/* The poller takes the whole list and gives back what is still pending (kept
 * in order, keep_tail = the last kept entry's next field; keep NULL: none)
 * and what is done. */
JI_HIDDEN ji_watch *ji_watch_detach(uint64_t *gen);
JI_HIDDEN void ji_watch_return(uint64_t gen, ji_watch *keep, ji_watch **keep_tail, ji_watch *done, int ndone);
JI_HIDDEN int ji_watch_pending(void);
JI_HIDDEN void ji_watch_atfork_child(void);

#pragma GCC visibility pop

#endif
