#ifndef UBIQFS_CFUSE3_SHIM_H
#define UBIQFS_CFUSE3_SHIM_H
#define FUSE_USE_VERSION 312
#include <stddef.h>
#include <fuse3/fuse_lowlevel.h>
#include <sys/xattr.h>
#include <sys/statvfs.h>
#include <fcntl.h>
#include <errno.h>

/* Function-like macros are not visible to Swift; these inline wrappers are. */
static inline int ubiq_fuse_session_loop_mt(struct fuse_session *se, struct fuse_loop_config *cfg) {
  return fuse_session_loop_mt(se, cfg);
}

/* Bit-field accessors on fuse_file_info (kept in C so the layout is the compiler's). */
static inline void ubiq_fi_set_keep_cache(struct fuse_file_info *fi, int v) { fi->keep_cache = v ? 1 : 0; }
static inline void ubiq_fi_set_direct_io(struct fuse_file_info *fi, int v) { fi->direct_io = v ? 1 : 0; }
static inline void ubiq_fi_set_cache_readdir(struct fuse_file_info *fi, int v) { fi->cache_readdir = v ? 1 : 0; }

/* Replies to a read straight from a cache file descriptor (spliced by libfuse when possible). */
static inline int ubiq_reply_fd(fuse_req_t req, int fd, size_t size, off_t off) {
  struct fuse_bufvec buf = FUSE_BUFVEC_INIT(size);
  buf.buf[0].flags = (enum fuse_buf_flags)(FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK);
  buf.buf[0].fd = fd;
  buf.buf[0].pos = off;
  return fuse_reply_data(req, &buf, (enum fuse_buf_copy_flags)0);
}

/* Copies a write request's `size` bytes of data (`fuse_buf_size(src)`) to a cache file
   descriptor at `off`: from memory, or straight from the pipe libfuse spliced the request into
   (no copy through user space). Returns the bytes written, or -errno. */
static inline ssize_t ubiq_write_buf_to_fd(struct fuse_bufvec *src, size_t size, int fd, off_t off) {
  struct fuse_bufvec dst = FUSE_BUFVEC_INIT(size);
  dst.buf[0].flags = (enum fuse_buf_flags)(FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK);
  dst.buf[0].fd = fd;
  dst.buf[0].pos = off;
  return fuse_buf_copy(&dst, src, (enum fuse_buf_copy_flags)0);
}

#ifndef RENAME_NOREPLACE
#define RENAME_NOREPLACE (1 << 0)
#endif
#ifndef RENAME_EXCHANGE
#define RENAME_EXCHANGE (1 << 1)
#endif
static const unsigned int UBIQ_RENAME_NOREPLACE = RENAME_NOREPLACE;
static const unsigned int UBIQ_RENAME_EXCHANGE = RENAME_EXCHANGE;
static const int UBIQ_XATTR_CREATE = XATTR_CREATE;
static const int UBIQ_XATTR_REPLACE = XATTR_REPLACE;
#ifndef ENODATA
#define ENODATA 61
#endif

#endif
