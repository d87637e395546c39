/* Opening a file below a directory descriptor in one system call, never through a
 * symlink, a magic link or ".." out of it: openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
 * RESOLVE_NO_MAGICLINKS), Linux 5.6 and later. The storage tree uses it for its reads
 * instead of walking "<fp>/<aa>/<bb>" one openat at a time (three descriptors a file). */
#ifndef HPKV_BENEATH_H
#define HPKV_BENEATH_H

/* A descriptor of dirfd/path opened with flags (and mode, with O_CREAT), or -errno:
 * -ENOSYS (or -EPERM from a seccomp filter) when the kernel lacks openat2, -ELOOP when a
 * component is a symlink, -EXDEV when the path leaves dirfd. */
int hpkv_open_beneath(int dirfd, const char *path, int flags, unsigned int mode);

#endif
