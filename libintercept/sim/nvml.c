/*
 * nvml.c - CPU stand-in for libnvidia-ml.so.1: the NVML calls jitrun's health check
 * makes (through the nvidia-ml-py wheel's pynvml), with device faults a test can
 * inject while a job runs.
 *
 * ABI: the functions pynvml looks up by name, with NVML's argument and return types
 * (nvmlReturn_t codes, nvmlDevice_t / nvmlEventSet_t opaque pointers, the
 * nvmlEventData_t layout). There is no nvml.h here; the layout is the one pynvml
 * declares (c_nvmlEventData_t: device, eventType, eventData, gpuInstanceId,
 * computeInstanceId).
 *
 * Devices: JITSIM_NVML_DEVICES (default 2). State: the file named by
 * JITSIM_NVML_STATE, re-read on every call, one device per line:
 *     device=1 lost                 every call on it returns NVML_ERROR_GPU_IS_LOST
 *     device=0 xid=79               an XID event (delivered once per event set)
 *     device=0 ecc_uncorrected=3    the volatile uncorrected ECC count
 * A missing file means every device is healthy.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define API __attribute__((visibility("default")))
#define MAX_DEV 16

typedef int nvmlReturn_t;
enum {
  NVML_SUCCESS = 0,
  NVML_ERROR_UNINITIALIZED = 1,
  NVML_ERROR_INVALID_ARGUMENT = 2,
  NVML_ERROR_NOT_SUPPORTED = 3,
  NVML_ERROR_INSUFFICIENT_SIZE = 7,
  NVML_ERROR_TIMEOUT = 10,
  NVML_ERROR_GPU_IS_LOST = 15,
};
#define EVENT_XID_CRITICAL 0x8ULL
#define MEMORY_ERROR_UNCORRECTED 1

struct device {
  unsigned index;
};
typedef struct device *nvmlDevice_t;

typedef struct {
  nvmlDevice_t device;
  unsigned long long eventType;
  unsigned long long eventData;
  unsigned gpuInstanceId;
  unsigned computeInstanceId;
} nvmlEventData_t;

struct event_set {
  int registered[MAX_DEV];
  unsigned delivered_xid[MAX_DEV];
};
typedef struct event_set *nvmlEventSet_t;

struct state {
  int lost[MAX_DEV];
  unsigned xid[MAX_DEV];
  unsigned long long ecc[MAX_DEV];
};

static struct device devices[MAX_DEV];
static int inited;

static unsigned count(void) {
  const char *s = getenv("JITSIM_NVML_DEVICES");
  long n = s ? strtol(s, NULL, 10) : 2;
  return n < 0 ? 0 : n > MAX_DEV ? MAX_DEV : (unsigned)n;
}

static void read_state(struct state *st) {
  memset(st, 0, sizeof *st);
  const char *path = getenv("JITSIM_NVML_STATE");
  FILE *f = path ? fopen(path, "r") : NULL;
  if (!f) return;
  char line[256];
  while (fgets(line, sizeof line, f)) {
    unsigned d;
    if (sscanf(line, "device=%u", &d) != 1 || d >= MAX_DEV) continue;
    const char *p;
    if (strstr(line, " lost")) st->lost[d] = 1;
    if ((p = strstr(line, "xid="))) st->xid[d] = (unsigned)strtoul(p + 4, NULL, 10);
    if ((p = strstr(line, "ecc_uncorrected="))) st->ecc[d] = strtoull(p + 16, NULL, 10);
  }
  fclose(f);
}

/* The device behind a handle, or an error code for a bad or lost one. */
static nvmlReturn_t dev_of(nvmlDevice_t h, struct state *st) {
  if (!inited) return NVML_ERROR_UNINITIALIZED;
  if (h < devices || h >= devices + count()) return NVML_ERROR_INVALID_ARGUMENT;
  read_state(st);
  return st->lost[h->index] ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
}

static nvmlReturn_t put(char *buf, unsigned len, const char *s) {
  if (!buf) return NVML_ERROR_INVALID_ARGUMENT;
  if (strlen(s) + 1 > len) return NVML_ERROR_INSUFFICIENT_SIZE;
  strcpy(buf, s);
  return NVML_SUCCESS;
}

API nvmlReturn_t nvmlInitWithFlags(unsigned flags) {
  (void)flags;
  for (unsigned i = 0; i < MAX_DEV; i++) devices[i].index = i;
  inited++;
  return NVML_SUCCESS;
}
API nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
API nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

API nvmlReturn_t nvmlShutdown(void) {
  if (!inited) return NVML_ERROR_UNINITIALIZED;
  inited--;
  return NVML_SUCCESS;
}

API const char *nvmlErrorString(nvmlReturn_t r) {
  switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
  }
}

API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned len) {
  return put(version, len, "jitsim-nvml-1");
}

API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned *n) {
  if (!inited) return NVML_ERROR_UNINITIALIZED;
  if (!n) return NVML_ERROR_INVALID_ARGUMENT;
  *n = count();
  return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned index, nvmlDevice_t *h) {
  if (!inited) return NVML_ERROR_UNINITIALIZED;
  if (!h || index >= count()) return NVML_ERROR_INVALID_ARGUMENT;
  *h = &devices[index];
  return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t h, char *uuid, unsigned len) {
  struct state st;
  nvmlReturn_t r = dev_of(h, &st);
  if (r) return r;
  char s[64];
  snprintf(s, sizeof s, "GPU-00000000-0000-0000-0000-%012u", h->index);
  return put(uuid, len, s);
}

API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t h, char *name, unsigned len) {
  struct state st;
  nvmlReturn_t r = dev_of(h, &st);
  return r ? r : put(name, len, "jitsim stand-in GPU");
}

API nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t h, int error_type, int counter_type,
                                             unsigned long long *n) {
  (void)counter_type;
  struct state st;
  nvmlReturn_t r = dev_of(h, &st);
  if (r) return r;
  if (!n) return NVML_ERROR_INVALID_ARGUMENT;
  *n = error_type == MEMORY_ERROR_UNCORRECTED ? st.ecc[h->index] : 0;
  return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t h, unsigned long long *types) {
  struct state st;
  nvmlReturn_t r = dev_of(h, &st);
  if (r) return r;
  if (!types) return NVML_ERROR_INVALID_ARGUMENT;
  *types = EVENT_XID_CRITICAL;
  return NVML_SUCCESS;
}

API nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
  if (!inited) return NVML_ERROR_UNINITIALIZED;
  if (!set) return NVML_ERROR_INVALID_ARGUMENT;
  *set = calloc(1, sizeof **set);
  return *set ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
}

API nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t h, unsigned long long types, nvmlEventSet_t set) {
  struct state st;
  nvmlReturn_t r = dev_of(h, &st);
  if (r) return r;
  if (!set) return NVML_ERROR_INVALID_ARGUMENT;
  if (types & ~EVENT_XID_CRITICAL) return NVML_ERROR_NOT_SUPPORTED;
  set->registered[h->index] = 1;
  return NVML_SUCCESS;
}

API nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned timeout_ms) {
  if (!inited) return NVML_ERROR_UNINITIALIZED;
  if (!set || !data) return NVML_ERROR_INVALID_ARGUMENT;
  struct timespec nap = {0, 10 * 1000 * 1000};
  for (unsigned waited = 0;; waited += 10) {
    struct state st;
    read_state(&st);
    for (unsigned i = 0; i < count(); i++) {
      if (set->registered[i] && st.xid[i] && st.xid[i] != set->delivered_xid[i]) {
        set->delivered_xid[i] = st.xid[i];
        memset(data, 0, sizeof *data);
        data->device = &devices[i];
        data->eventType = EVENT_XID_CRITICAL;
        data->eventData = st.xid[i];
        return NVML_SUCCESS;
      }
    }
    if (waited >= timeout_ms) return NVML_ERROR_TIMEOUT;
    nanosleep(&nap, NULL);
  }
}

API nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
  if (!set) return NVML_ERROR_INVALID_ARGUMENT;
  free(set);
  return NVML_SUCCESS;
}
