/* Read-only fill level of a ring file (see ringpeek.h).
 *
 * The ring header is private to ring.c; this file mirrors the part of it that
 * it reads, for HPKV_RING_VERSION 1 only. A layout change in ring.c bumps
 * HPKV_RING_VERSION (ring.h), and then hpkv_ring_peek answers
 * HPKV_RING_EVERSION instead of reading the wrong bytes; tests/test_top.py
 * checks the peeked depth against hpkv_ring_depth of an attached end.
 */
#define _GNU_SOURCE
#include "ringpeek.h"

#include <errno.h>
#include <fcntl.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stddef.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define PEEK_RING_MAGIC 0x31474e49524b5048ULL /* "HPKRING1", as ring.c */
#define PEEK_HDR_SIZE 4096u
#define PEEK_LINE 128

#if HPKV_RING_VERSION != 1
#error "ringpeek.c mirrors the version-1 ring header of ring.c: update the mirror below"
#endif

/* Mirrors struct hpkv_shm_prefix / hpkv_shm_end / hpkv_ring_hdr of ring.c (version 1). */
struct peek_end {
    uint32_t gen, state;
    int32_t pid;
    uint32_t _pad;
    uint64_t start_time;
};

struct peek_prefix {
    uint64_t magic;
    uint32_t version;
    uint32_t desc_size;
    uint64_t file_size;
    int32_t creator_pid;
    uint32_t creator_role;
    uint64_t creator_start;
};

struct peek_ring_hdr {
    alignas(PEEK_LINE) struct peek_prefix pre;
    uint32_t capacity;
    uint32_t _pad0;
    uint64_t data_offset;
    char doorbell_name[64];
    alignas(PEEK_LINE) struct peek_end end[2];
    alignas(PEEK_LINE) _Atomic uint64_t tail; /* producer-owned */
    alignas(PEEK_LINE) _Atomic uint64_t head; /* consumer-owned */
};

_Static_assert(offsetof(struct peek_ring_hdr, capacity) == 40, "ring header v1: capacity at 40");
_Static_assert(offsetof(struct peek_ring_hdr, tail) == 256, "ring header v1: tail at 256");
_Static_assert(offsetof(struct peek_ring_hdr, head) == 384, "ring header v1: head at 384");

static int peek_counts(const char *path, uint64_t *tail_out, uint64_t *head_out,
                       uint32_t *capacity);

int hpkv_ring_peek(const char *path, uint64_t *depth, uint32_t *capacity)
{
    uint64_t head = 0, tail = 0;
    int rc = peek_counts(path, &tail, &head, capacity);
    if (rc == 0) {
        uint64_t d = tail >= head ? tail - head : 0;
        *depth = d > *capacity ? *capacity : d;
    }
    return rc;
}

int hpkv_ring_peek_counts(const char *path, uint64_t *pushed, uint64_t *popped)
{
    uint32_t cap = 0;
    return peek_counts(path, pushed, popped, &cap);
}

static int peek_counts(const char *path, uint64_t *tail_out, uint64_t *head_out, uint32_t *capacity)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int rc = -errno;
        close(fd);
        return rc;
    }
    if ((size_t)st.st_size < PEEK_HDR_SIZE) {
        close(fd);
        return HPKV_RING_EBADFILE;
    }
    /* Only the header page, read-only: a monitor can never disturb the ring. */
    void *p = mmap(NULL, PEEK_HDR_SIZE, PROT_READ, MAP_SHARED, fd, 0);
    int rc = p == MAP_FAILED ? -errno : 0;
    close(fd);
    if (rc)
        return rc;
    const struct peek_ring_hdr *h = p;
    if (h->pre.magic != PEEK_RING_MAGIC) {
        rc = HPKV_RING_EBADFILE;
    } else if (h->pre.version != HPKV_RING_VERSION || h->pre.desc_size != sizeof(hpkv_desc)) {
        rc = HPKV_RING_EVERSION;
    } else if (h->pre.file_size != (uint64_t)st.st_size || h->capacity < 2 ||
               (h->capacity & (h->capacity - 1))) {
        rc = HPKV_RING_EBADFILE;
    } else {
        /* ACQUIRE, head first (as hpkv_ring_depth): tail read later is >= that head. */
        uint64_t head =
            atomic_load_explicit(&((struct peek_ring_hdr *)h)->head, memory_order_acquire);
        uint64_t tail =
            atomic_load_explicit(&((struct peek_ring_hdr *)h)->tail, memory_order_acquire);
        *tail_out = tail;
        *head_out = head;
        *capacity = h->capacity;
    }
    munmap(p, PEEK_HDR_SIZE);
    return rc;
}
