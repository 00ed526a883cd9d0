/* An LD_PRELOAD shim for tests/crash/test_storage_faults.py: while the file named by
 * RELAY_TEST_FAIL_SYNC exists, fsync and fdatasync of any file whose name ends in "-wal"
 * fail with EIO, as a failing disk's would; every other call goes to libc. The writes
 * themselves succeed (they land in the page cache), so a commit whose sync failed is still
 * in the file: what a real disk can do, and why its outcome is unknown. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int failing(int fd) {
  const char *trigger = getenv("RELAY_TEST_FAIL_SYNC");
  struct stat st;
  char link[64], path[4096];
  ssize_t n;
  if (trigger == NULL || stat(trigger, &st) != 0) return 0;
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  n = readlink(link, path, sizeof path - 1);
  if (n < 4) return 0;
  path[n] = 0;
  return strcmp(path + n - 4, "-wal") == 0;
}

int fdatasync(int fd) {
  static int (*real)(int);
  if (failing(fd)) {
    errno = EIO;
    return -1;
  }
  if (real == NULL) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
  return real(fd);
}

int fsync(int fd) {
  static int (*real)(int);
  if (failing(fd)) {
    errno = EIO;
    return -1;
  }
  if (real == NULL) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
  return real(fd);
}
