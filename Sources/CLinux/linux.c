#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>

#include "CLinux.h"

int ubiq_fallocate_keep_size(int fd, long long offset, long long length) {
  return fallocate(fd, FALLOC_FL_KEEP_SIZE, (off_t)offset, (off_t)length) == 0 ? 0 : errno;
}
