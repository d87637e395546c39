/* hpkv rings: lock-free SPSC descriptor rings and doorbells in shared memory.
 *
 * The descriptor (hpkv_desc) and its kinds are defined here, once; Python reads
 * the kind values from the compiled module (hpkv._native.lib) and mirrors the
 * layout as a numpy dtype (hpkv/ring/desc.py), checked against sizeof at import.
 * The invariants and the wake-up protocol are written at the top of ring.c.
 */
#ifndef HPKV_RING_H
#define HPKV_RING_H

#include <stddef.h>
#include <stdint.h>

/* Version of the ring/doorbell *file* layout (header + slots). A process never
 * attaches a file of another version; a stale file of an older version is
 * replaced on create. Independent of HPKV_NATIVE_ABI (core.h). */
#define HPKV_RING_VERSION 1

enum hpkv_desc_kind {
    HPKV_DESC_NONE = 0,
    HPKV_DESC_COPY_SAVE = 1, /* device blocks -> pool slots */
    HPKV_DESC_COPY_LOAD = 2, /* pool slots -> device blocks */
    HPKV_DESC_SPILL = 3,     /* pool slot -> KV file */
    HPKV_DESC_PROMOTE = 4,   /* KV file -> pool slot */
    HPKV_DESC_LOOKUP = 5,
    HPKV_DESC_RESERVE = 6,
    HPKV_DESC_COMMIT = 7,
    HPKV_DESC_PIN = 8,
    HPKV_DESC_UNPIN = 9,
    HPKV_DESC_CLEAR = 10,
    HPKV_DESC_COMPLETION = 11, /* echoes the request's seq; status 0 or <0 */
    HPKV_DESC_ERROR = 12,
    HPKV_DESC_SHUTDOWN = 13,
    HPKV_DESC_KIND_COUNT = 14
};

typedef struct hpkv_desc {
    uint16_t kind; /* enum hpkv_desc_kind */
    uint16_t flags;
    int32_t status;  /* 0 ok, <0 -errno or hpkv error code */
    uint64_t seq;    /* request sequence number, echoed in the completion */
    uint64_t arg[6]; /* kind-specific */
} hpkv_desc;

_Static_assert(sizeof(hpkv_desc) == 64, "hpkv_desc must be exactly 64 bytes");

/* timeout_s of the blocking calls, in seconds (a double: Python passes its float as is):
 *   finite >= 0: relative (0: do not wait); negative: 0; +INFINITY (or > 1e9): no limit;
 *   NAN: keep the deadline of this handle's previous wait (a retry after -EINTR that
 *   does not extend it). */

/* Ring roles (which end a process holds). */
enum hpkv_ring_role { HPKV_RING_PRODUCER = 0, HPKV_RING_CONSUMER = 1 };

/* Peer/end states recorded in the file header. */
enum hpkv_end_state { HPKV_END_NONE = 0, HPKV_END_ATTACHED = 1, HPKV_END_CLOSED = 2 };

/* Error codes returned (negated errno values are returned as well). */
enum hpkv_ring_err {
    HPKV_RING_EPEER_DEAD = -1001,   /* the other end's process is gone without closing */
    HPKV_RING_EPEER_CLOSED = -1002, /* the other end closed its end */
    HPKV_RING_EBADFILE = -1003,     /* not a ring/doorbell file (bad magic, size) */
    HPKV_RING_EVERSION = -1004,     /* file of another HPKV_RING_VERSION or descriptor size */
    HPKV_RING_EBUSY = -1005,        /* that end is held by a live process */
    HPKV_RING_ECAPACITY = -1006     /* capacity not a power of two in [2, 2^24] */
};

/* Status of a request's answer or a job's completion besides 0 and -errno
 * (hpkv.protocol.errors.Status mirrors it). */
enum hpkv_status {
    HPKV_OK = 0,
    HPKV_E_NO_NAMESPACE = -2001,  /* namespace not attached */
    HPKV_E_TOO_MANY_KEYS = -2002, /* the keys or their answer do not fit the mailbox */
    HPKV_E_BAD_REQUEST = -2003,
    HPKV_E_WORKER_DIED = -2004, /* the worker died during the job */
    HPKV_E_CORRUPT = -2005,   /* a KV file failed its header/length/checksum check (quarantined) */
    HPKV_E_NOT_OWNER = -2006, /* commit/abort of a reservation another client made */
    HPKV_E_INTERNAL =
        -2007, /* the server failed inside the call (logged there); it keeps serving */
    HPKV_E_STALE_SLOT =
        -2008 /* a save into a slot whose reservation was released: nothing written */
};

/* Results of hpkv_shm_probe() on an existing file's header bytes. */
enum hpkv_probe { HPKV_PROBE_STALE = 0, HPKV_PROBE_LIVE = 1 };

typedef struct hpkv_ring hpkv_ring;         /* process-local handle */
typedef struct hpkv_doorbell hpkv_doorbell; /* process-local handle */

/* Process identity (for liveness): start time in clock ticks since boot,
 * /proc/<pid>/stat field 22; 0 when the process does not exist (or is a zombie). */
uint64_t hpkv_proc_start_time(int32_t pid);
/* 1 if the process pid with that start time is running (start 0: pid check only). */
int hpkv_proc_alive(int32_t pid, uint64_t start_time);

/* Process-wide: whether ends claimed from now on are registered for kernel death
 * notices (see LIVENESS in ring.c; default on). Off, peers wait on them in slices. */
void hpkv_ring_set_death_notices(int enabled);
/* Offset in a ring file of an end's life word (its death-notice futex); for tests. */
size_t hpkv_ring_life_offset(int role);

/* Inspects the first bytes of an existing ring or doorbell file (read by the
 * caller): returns HPKV_PROBE_LIVE if its creator still holds it,
 * HPKV_PROBE_STALE if the creator died or released it, HPKV_RING_EBADFILE if it
 * is not an hpkv ring/doorbell file. *creator_pid is set when the magic matched. */
int hpkv_shm_probe(const void *hdr, size_t len, int32_t *creator_pid);
/* pid recorded for end `role` of a ring file's header bytes (0 ring producer,
 * 1 ring consumer; 0 for a doorbell's owner); -1 if not a ring/doorbell file. */
int32_t hpkv_shm_end_pid(const void *hdr, size_t len, int role);
size_t hpkv_ring_file_size(uint32_t capacity);
size_t hpkv_doorbell_file_size(void);

/* Maps fd (MAP_SHARED | MAP_POPULATE) and claims the role's end. With create,
 * the file is fallocated to hpkv_ring_file_size(capacity) and formatted first
 * (the caller then publishes it by rename). NULL on error, *err < 0. */
hpkv_ring *hpkv_ring_map(int fd, int role, int create, uint32_t capacity, int *err);
/* Releases this process's end (state CLOSED, so the peer stops waiting) and unmaps. */
void hpkv_ring_unmap(hpkv_ring *r);

/* Non-blocking: move up to n descriptors; return the number moved (0 = full/empty). */
uint32_t hpkv_ring_try_push(hpkv_ring *r, const hpkv_desc *src, uint32_t n);
uint32_t hpkv_ring_try_pop(hpkv_ring *r, hpkv_desc *dst, uint32_t n);
/* Blocking: spin, then sleep in slices until all n are pushed or timeout_s
 * passes. Returns the count pushed; when < n, hpkv_ring_last_error
 * says why (0 timeout, HPKV_RING_EPEER_*, -EINTR). */
int64_t hpkv_ring_push_wait(hpkv_ring *r, const hpkv_desc *src, uint32_t n, double timeout_s);
/* Blocking: waits for at least one descriptor, then pops up to n. Returns the
 * count (>0), 0 on timeout, or <0 (HPKV_RING_EPEER_*, -EINTR). Descriptors
 * already in the ring are returned before a dead peer is reported. */
int64_t hpkv_ring_pop_wait(hpkv_ring *r, hpkv_desc *dst, uint32_t n, double timeout_s);
int hpkv_ring_last_error(const hpkv_ring *r);

/* The calls hpkv._ringcall (native/python/ringcall.c) makes on the hot path, handed
 * out as one table so that module needs no copy of this code. */
#define HPKV_RING_CALLS_VERSION 1
struct hpkv_ring_calls {
    uint32_t size, version; /* sizeof, HPKV_RING_CALLS_VERSION: checked when it binds */
    uint32_t (*try_push)(hpkv_ring *r, const hpkv_desc *src, uint32_t n);
    int64_t (*push_wait)(hpkv_ring *r, const hpkv_desc *src, uint32_t n, double timeout_s);
    uint32_t (*try_pop)(hpkv_ring *r, hpkv_desc *dst, uint32_t n);
    int64_t (*pop_wait)(hpkv_ring *r, hpkv_desc *dst, uint32_t n, double timeout_s);
    int (*last_error)(const hpkv_ring *r);
};
const struct hpkv_ring_calls *hpkv_ring_call_table(void);

uint64_t hpkv_ring_depth(const hpkv_ring *r);
uint32_t hpkv_ring_capacity(const hpkv_ring *r);
int hpkv_ring_role(const hpkv_ring *r);
/* spin_ns: busy-poll time before sleeping; slice_ns: longest single futex sleep when the
 * peer's death cannot be notified (the peer is re-checked after each; see LIVENESS in ring.c). */
void hpkv_ring_set_wait(hpkv_ring *r, int64_t spin_ns, int64_t slice_ns);
/* 0 if the peer is attached and alive or not attached yet, else HPKV_RING_EPEER_*. */
int hpkv_ring_peer_status(hpkv_ring *r);
/* The end's identity as recorded in the header (role 0 producer, 1 consumer). */
void hpkv_ring_end_info(const hpkv_ring *r, int role, int32_t *pid, uint64_t *start_time,
                        uint32_t *generation, uint32_t *state);
/* Wait counters of this handle: sleeps (futex waits entered), wakes (futex wakes sent). */
void hpkv_ring_stats(const hpkv_ring *r, uint64_t *sleeps, uint64_t *wakes);

/* Doorbell binding. The name is recorded in the ring header so a producer that
 * attaches later finds it; bind makes this handle's pushes ring it (producer)
 * or lets hpkv_doorbell_wait watch this ring (consumer). */
int hpkv_ring_set_doorbell_name(hpkv_ring *r, const char *name);
int hpkv_ring_get_doorbell_name(const hpkv_ring *r, char *out, size_t out_len);
void hpkv_ring_bind_doorbell(hpkv_ring *r, hpkv_doorbell *b);

hpkv_doorbell *hpkv_doorbell_map(int fd, int create, int *err);
void hpkv_doorbell_unmap(hpkv_doorbell *b);
/* Wakes the doorbell's consumer; sticky: a ring with no sleeper is seen by the next wait. */
void hpkv_doorbell_ring(hpkv_doorbell *b);
/* Consumer: returns 1 as soon as the doorbell was rung or one of rings[0..n) is
 * non-empty, 0 on timeout, -EINTR on a signal. */
int hpkv_doorbell_wait(hpkv_doorbell *b, hpkv_ring *const *rings, size_t n, double timeout_s);
void hpkv_doorbell_set_spin(hpkv_doorbell *b, int64_t spin_ns);
void hpkv_doorbell_owner_info(const hpkv_doorbell *b, int32_t *pid, uint64_t *start_time,
                              uint32_t *generation, uint32_t *state);
void hpkv_doorbell_stats(const hpkv_doorbell *b, uint64_t *sleeps, uint64_t *wakes);

#endif
