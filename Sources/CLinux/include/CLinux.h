#ifndef UBIQFS_CLINUX_H
#define UBIQFS_CLINUX_H

/* Linux calls that Swift's Glibc module does not show (they need _GNU_SOURCE). */

/* fallocate(fd, FALLOC_FL_KEEP_SIZE, offset, length): reserves space without changing the
   file's size. Returns 0, or the errno. */
int ubiq_fallocate_keep_size(int fd, long long offset, long long length);

#endif
