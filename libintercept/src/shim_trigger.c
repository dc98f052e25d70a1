/*
 * shim_trigger.c - the just-in-time trigger (paper §3.2): the registered
 * handler, the JSON event line, the once-per-process latch, and the exit
 * status of JITCKPT_ON_HANG=exit and of a recovery's fallback.
 *
 * Running the handler: make the private stream, set trigger_active (hooks
 * then redirect copies and the trigger thread's synchronizes to the private
 * stream), ask parked GIL holders to release the GIL (shim_gil.c), call the
 * handler with this thread marked as the trigger thread and its replay log
 * paused, then clear the flags.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "jitintercept.h"
#include "shim_base.h"

_Atomic int ji_trigger_active;
int ji_redirect_enabled = 1;
static _Atomic int fired;
static int cfg_exit_code = 75;
static _Atomic(jitintercept_handler_fn) handler_fn;
static _Atomic(void *) handler_user;

void ji_trigger_configure(void) {
  cfg_exit_code = (int)ji_env_num("JITCKPT_HANG_EXIT_CODE", 75);
  /* 0 only for the negative control of the redirect test. */
  const char *rd = ji_getenv("JITCKPT_REDIRECT");
  ji_redirect_enabled = !(rd && !strcmp(rd, "0"));
}

int ji_trigger_claim(void) {
  int expected = 0;
  return atomic_compare_exchange_strong(&fired, &expected, 1);
}
int ji_trigger_fired(void) { return atomic_load_explicit(&fired, memory_order_relaxed); }
void ji_trigger_release(void) { atomic_store(&fired, 0); }

void ji_event_write(const char *json) {
  const char *path = ji_getenv("JITCKPT_SHIM_EVENTS");
  if (!path) path = ji_getenv("JITCKPT_EVENT_LOG");
  int fd = path ? open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644) : 2;
  if (fd < 0) fd = 2;
  size_t n = strlen(json);
  /* One write() per line: O_APPEND keeps lines from several ranks intact. */
  char *buf = malloc(n + 1);
  if (buf) {
    memcpy(buf, json, n);
    buf[n] = '\n';
    ssize_t w = write(fd, buf, n + 1);
    (void)w;
    free(buf);
  }
  if (fd != 2) close(fd);
}

/* Caller: the thread that fires. Returns with the flags set when `done` is 0
 * (the process is about to exit). */
static void run_handler(jitintercept_handler_fn h, const char *json, int done) {
  ji_private_stream_make();
  atomic_store(&ji_trigger_active, 1);
  /* The handler usually needs the GIL; its holder may be parked in a
   * blocking call that will never return. */
  ji_gil_release_parked(0.5);
  ji_tls.trigger = 1;
  /* The handler's copies are not part of the minibatch being logged. */
  ji_tls.log_off = 1;
  h(json, atomic_load(&handler_user));
  if (!done) return;
  ji_tls.log_off = 0;
  ji_tls.trigger = 0;
  atomic_store(&ji_trigger_active, 0);
}

void ji_trigger_fire(const char *json) {
  jitintercept_handler_fn h = atomic_load(&handler_fn);
  if (!h || ji_getenv("JITCKPT_EVENT_LOG")) ji_event_write(json);
  if (h) run_handler(h, json, 1);
}

void ji_trigger_exit(void) { _exit(cfg_exit_code); }

/* In-place recovery is impossible: the existing path (the registered JIT
 * handler, i.e. the user-level save, then exit for the launcher to restart). */
void ji_trigger_fallback(void) {
  jitintercept_handler_fn h = atomic_load(&handler_fn);
  if (h) {
    char json[256];
    snprintf(json, sizeof json,
             "{\"event\": \"error\", \"source\": \"recovery_fallback\", \"rank\": %d, \"pid\": %d, "
             "\"on_hang\": \"recover\"}",
             ji_comm_rank(NULL), (int)getpid());
    run_handler(h, json, 0);
  }
  _exit(cfg_exit_code);
}

JI_API void jitintercept_set_handler(jitintercept_handler_fn fn, void *user) {
  atomic_store(&handler_user, user);
  atomic_store(&handler_fn, fn);
}
JI_API int jitintercept_trigger_active(void) { return atomic_load(&ji_trigger_active); }
JI_API void jitintercept_rearm(void) { ji_trigger_release(); }
