#define _GNU_SOURCE
#include "beneath.h"

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_openat2
#define SYS_openat2 437 /* the same number on every architecture (asm-generic) */
#endif

struct hpkv_open_how { /* struct open_how of <linux/openat2.h>, which older headers lack */
    uint64_t flags;
    uint64_t mode;
    uint64_t resolve;
};

#define HPKV_RESOLVE_NO_MAGICLINKS 0x02
#define HPKV_RESOLVE_NO_SYMLINKS 0x04
#define HPKV_RESOLVE_BENEATH 0x08

int hpkv_open_beneath(int dirfd, const char *path, int flags, unsigned int mode)
{
    struct hpkv_open_how how;
    memset(&how, 0, sizeof how);
    how.flags = (uint64_t)(unsigned int)flags;
    how.mode = mode;
    how.resolve = HPKV_RESOLVE_BENEATH | HPKV_RESOLVE_NO_SYMLINKS | HPKV_RESOLVE_NO_MAGICLINKS;
    long fd;
    do {
        fd = syscall(SYS_openat2, dirfd, path, &how, sizeof how);
    } while (fd < 0 && errno == EINTR);
    return fd < 0 ? -errno : (int)fd;
}
