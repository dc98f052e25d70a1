/*
 * shim_gil.c - signal-based GIL release (paper §3.2).
 *
 * Problem: the hang handler is Python (a cffi callback, which takes the GIL
 * with PyGILState_Ensure), but the thread holding the GIL may be stuck in a
 * blocking CUDA/NCCL call made without releasing it (ctypes.PyDLL, or a C
 * extension that forgot Py_BEGIN_ALLOW_THREADS).
 *
 * Design: we only ever release the GIL of a thread that is *parked*, i.e.
 * inside one of our JI_BLOCK hooks, between ji_park_enter() and ji_park_exit().
 * At that point the thread executes no interpreter code and holds no
 * interpreter lock; releasing its GIL there is exactly what a
 * Py_BEGIN_ALLOW_THREADS around the call would have done. The release happens
 * in a signal handler run *on that thread*, because only the holder may
 * release the GIL:
 *
 *  watchdog thread                         parked thread (holds GIL)
 *  ---------------                         -------------------------
 *  ji_gil_release_parked():
 *    resolve Py* symbols (dlsym; not in a handler)
 *    install SIGUSR1 handler (sigaction)
 *    for each registry slot with parked=1:
 *      rt_tgsigqueueinfo(tid, SIGUSR1,     -> gil_handler() runs on it:
 *                        cookie)                if it is ours (SI_QUEUE + cookie
 *                                               + our pid) and tls_parked and this
 *                                               thread holds the GIL:
 *                                                 tls_saved = PyEval_SaveThread()
 *                                               ack++ ; return  (the blocking call
 *                                               resumes: SA_RESTART / futex loop)
 *    wait (bounded) for acks
 *  handler(json) -> PyGILState_Ensure
 *  succeeds because the GIL is free.
 *                                          if the blocking call ever returns:
 *                                            ji_park_exit(): tls_parked = 0,
 *                                            then if tls_saved: PyEval_RestoreThread
 *                                            (waits for the GIL like any thread).
 *
 * What runs in the signal handler, and why it is acceptable:
 *  - async-signal-safe: errno save/restore, getpid, reads of TLS and
 *    sig_atomic_t/atomics, atomic increments.
 *  - NOT formally async-signal-safe: _PyThreadState_UncheckedGet /
 *    PyGILState_GetThisThreadState (a thread-local/atomic read) and
 *    PyEval_SaveThread (locks the GIL's internal mutex and signals its
 *    condvar). They are only reached when the interrupted code is our parked
 *    bracket, i.e. inside the CUDA/NCCL runtime, never inside the interpreter
 *    (which is the only code that takes the GIL mutex), so the mutex cannot
 *    be held by this thread. The runtime's own locks are untouched.
 *  - Foreign SIGUSR1s (not SI_QUEUE with our cookie from our pid) are passed
 *    to the previously installed disposition.
 * Ordering: ji_park_exit clears tls_parked *before* it reads tls_saved (with a
 * signal fence), so a signal arriving at any point either releases the GIL
 * and is then seen by the exit path, or sees tls_parked == 0 and does nothing.
 *
 * Threads: any thread may park; only the watchdog signals; only the parked
 * thread itself touches its tls_saved. The registry (reg_mu) is locked only
 * when a thread parks for the first time and when it exits (TSD destructor).
 *
 * JITCKPT_GIL_SIGNAL: signal number (default SIGUSR1=10); 0 disables.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "shim_base.h"

#define JI_COOKIE 0x4a49544b /* "JITK" */
#define REG_MAX 1024

struct reg_slot {
  _Atomic pid_t tid;
  _Atomic int parked;
};
static struct reg_slot reg[REG_MAX];
static pthread_mutex_t reg_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_key_t reg_key;
static pthread_once_t reg_once = PTHREAD_ONCE_INIT;

static JI_TLS struct reg_slot *tls_slot;
static JI_TLS volatile sig_atomic_t tls_parked;
static JI_TLS void *volatile tls_saved;

static _Atomic uint64_t sig_acks;

typedef int (*py_int_fn)(void);
typedef void *(*py_ptr_fn)(void);
typedef void (*py_restore_fn)(void *);
static struct {
  py_int_fn is_initialized;
  py_ptr_fn unchecked_get; /* thread state holding the GIL / attached here */
  py_ptr_fn this_thread_state;
  py_ptr_fn save_thread;
  py_restore_fn restore_thread;
} py;

static void reg_release(void *p) {
  struct reg_slot *s = p;
  atomic_store(&s->parked, 0);
  atomic_store(&s->tid, 0);
}
static void reg_init(void) { pthread_key_create(&reg_key, reg_release); }

static struct reg_slot *reg_self(void) {
  if (JI_LIKELY(tls_slot != NULL)) return tls_slot;
  pthread_once(&reg_once, reg_init);
  pid_t tid = (pid_t)syscall(SYS_gettid);
  pthread_mutex_lock(&reg_mu);
  for (int i = 0; i < REG_MAX; i++)
    if (atomic_load(&reg[i].tid) == 0) {
      atomic_store(&reg[i].tid, tid);
      tls_slot = &reg[i];
      break;
    }
  pthread_mutex_unlock(&reg_mu);
  if (tls_slot) pthread_setspecific(reg_key, tls_slot);
  return tls_slot;
}

void ji_park_enter(void) {
  struct reg_slot *s = reg_self();
  tls_parked = 1;
  atomic_signal_fence(memory_order_seq_cst);
  if (s) atomic_store_explicit(&s->parked, 1, memory_order_release);
}

void ji_park_exit(void) {
  if (tls_slot) atomic_store_explicit(&tls_slot->parked, 0, memory_order_relaxed);
  tls_parked = 0;
  atomic_signal_fence(memory_order_seq_cst);
  if (JI_UNLIKELY(tls_saved != NULL)) {
    void *ts = tls_saved;
    tls_saved = NULL;
    py.restore_thread(ts);
  }
}

static struct sigaction old_sa;

static void gil_handler(int sig, siginfo_t *si, void *uc) {
  if (!si || si->si_code != SI_QUEUE || si->si_value.sival_int != JI_COOKIE || si->si_pid != getpid()) {
    if (old_sa.sa_flags & SA_SIGINFO) {
      if (old_sa.sa_sigaction) old_sa.sa_sigaction(sig, si, uc);
    } else if (old_sa.sa_handler != SIG_IGN && old_sa.sa_handler != SIG_DFL && old_sa.sa_handler) {
      old_sa.sa_handler(sig);
    } else if (old_sa.sa_handler == SIG_DFL) {
      /* Keep the default meaning (terminate) for signals that are not ours. */
      signal(sig, SIG_DFL);
      raise(sig);
    }
    return;
  }
  int saved_errno = errno;
  if (tls_parked && !tls_saved) {
    void *cur = py.unchecked_get();
    if (cur && cur == py.this_thread_state()) {
      tls_saved = py.save_thread();
      atomic_fetch_add(&ji_stats[JI_ST_GIL_RELEASED], 1);
    }
  }
  atomic_fetch_add(&sig_acks, 1);
  errno = saved_errno;
}

static int py_resolve(void) {
  if (py.save_thread) return 1;
  py.is_initialized = (py_int_fn)dlsym(RTLD_DEFAULT, "Py_IsInitialized");
  py.unchecked_get = (py_ptr_fn)dlsym(RTLD_DEFAULT, "PyThreadState_GetUnchecked"); /* 3.13+ */
  if (!py.unchecked_get) py.unchecked_get = (py_ptr_fn)dlsym(RTLD_DEFAULT, "_PyThreadState_UncheckedGet");
  py.this_thread_state = (py_ptr_fn)dlsym(RTLD_DEFAULT, "PyGILState_GetThisThreadState");
  py.restore_thread = (py_restore_fn)dlsym(RTLD_DEFAULT, "PyEval_RestoreThread");
  py_ptr_fn save = (py_ptr_fn)dlsym(RTLD_DEFAULT, "PyEval_SaveThread");
  if (!py.is_initialized || !py.unchecked_get || !py.this_thread_state || !py.restore_thread || !save) return 0;
  py.save_thread = save; /* published last: the handler and park_exit test it */
  return 1;
}

int ji_gil_release_parked(double wait_s) {
  const char *env = ji_getenv("JITCKPT_GIL_SIGNAL");
  int signo = env ? atoi(env) : SIGUSR1;
  if (signo <= 0 || signo >= NSIG) return 0;
  if (!py_resolve() || !py.is_initialized()) return 0;
  /* (Re)install at every trigger: the application (Python's signal module)
   * may have replaced our disposition since the last one. */
  struct sigaction cur;
  if (sigaction(signo, NULL, &cur) != 0) return 0;
  if (!(cur.sa_flags & SA_SIGINFO) || cur.sa_sigaction != gil_handler) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = gil_handler;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    old_sa = cur;
    if (sigaction(signo, &sa, NULL) != 0) return 0;
  }
  uint64_t base = atomic_load(&sig_acks);
  int sent = 0;
  pid_t pid = getpid();
  for (int i = 0; i < REG_MAX; i++) {
    pid_t tid = atomic_load(&reg[i].tid);
    if (!tid || !atomic_load(&reg[i].parked)) continue;
    siginfo_t si;
    memset(&si, 0, sizeof si);
    si.si_signo = signo;
    si.si_code = SI_QUEUE;
    si.si_pid = pid;
    si.si_uid = getuid();
    si.si_value.sival_int = JI_COOKIE;
    if (syscall(SYS_rt_tgsigqueueinfo, pid, tid, signo, &si) == 0) sent++;
  }
  atomic_fetch_add(&ji_stats[JI_ST_GIL_SIGNALS], (uint64_t)sent);
  double deadline = ji_now() + wait_s;
  while (atomic_load(&sig_acks) - base < (uint64_t)sent && ji_now() < deadline) {
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  return sent;
}
