/*
 * shim_watchdog.h - the watchdog layer: the polling thread (shim_watchdog.c).
 * Layers and their headers: shim_base.h.
 */
#ifndef JI_SHIM_WATCHDOG_H
#define JI_SHIM_WATCHDOG_H

#include "shim_recovery.h"

/* Hidden by default, as in shim_base.h (why: there). */
#pragma GCC visibility push(hidden)

/* ---- the watchdog thread (shim_watchdog.c) ---- */
JI_HIDDEN void ji_wd_start(void);

#pragma GCC visibility pop

#endif
