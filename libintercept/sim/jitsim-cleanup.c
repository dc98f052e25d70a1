/*
 * jitsim-cleanup - remove shared-memory segments the stand-in NCCL left in
 * /dev/shm. A segment outlives its job only when a communicator never
 * finished initializing (a rank died or never arrived before all ranks had
 * mapped it) and nobody called ncclCommAbort/Destroy on it.
 *
 *   jitsim-cleanup [--stale] [--dry-run] [JOB]
 *
 * Removes /dev/shm/jitsim-JOB-* (JOB as set in JITSIM_JOB; all jobs when
 * omitted). --stale keeps segments whose creating process (the pid in the
 * name) is still alive. Prints each removed name.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

int main(int argc, char **argv) {
  int stale = 0, dry = 0;
  const char *job = NULL;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--stale")) stale = 1;
    else if (!strcmp(argv[i], "--dry-run")) dry = 1;
    else if (argv[i][0] == '-') {
      fprintf(stderr, "usage: %s [--stale] [--dry-run] [JOB]\n", argv[0]);
      return 2;
    } else job = argv[i];
  }
  char prefix[256];
  snprintf(prefix, sizeof prefix, "jitsim-%s%s", job ? job : "", job ? "-" : "");
  DIR *d = opendir("/dev/shm");
  if (!d) {
    perror("/dev/shm");
    return 1;
  }
  int rc = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (strncmp(e->d_name, prefix, strlen(prefix))) continue;
    if (stale) {
      /* name: jitsim-<job>-<pid>-...; the pid is the third field. */
      const char *p = strchr(e->d_name + 7, '-');
      long pid = p ? strtol(p + 1, NULL, 10) : 0;
      if (pid > 0 && (kill((pid_t)pid, 0) == 0 || errno == EPERM)) continue;
    }
    char name[300];
    snprintf(name, sizeof name, "/%s", e->d_name);
    if (!dry && shm_unlink(name) && errno != ENOENT) {
      perror(name);
      rc = 1;
      continue;
    }
    printf("%s\n", name);
  }
  closedir(d);
  return rc;
}
