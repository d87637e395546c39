/* hpkv rings: single-producer / single-consumer descriptor rings and doorbells
 * in shared memory (files on tmpfs, mapped MAP_SHARED by both processes).
 *
 * INVARIANTS (the whole correctness argument; everything below follows it)
 *
 *   head, tail  64-bit counters in the file header that only grow (they never
 *               wrap in practice: 2^64 descriptors). Slot of counter c is
 *               c & (capacity - 1); capacity is a power of two.
 *   tail        written ONLY by the producer: "slots [head, tail) are filled".
 *               The producer fills slots, then publishes them with a RELEASE
 *               store of tail; the consumer reads tail with ACQUIRE, so the
 *               slot contents it then reads are the ones written.
 *   head        written ONLY by the consumer: "slots before head may be reused".
 *               The consumer copies slots out, then RELEASEs head; the producer
 *               ACQUIREs head before overwriting, so it never overwrites a slot
 *               the consumer is still reading.
 *   empty       tail == head.          full   tail - head == capacity.
 *   Each side also keeps a process-local copy of its own counter and a cached
 *   copy of the other's, re-read only when the cache says full/empty, so a
 *   push or pop touches the other side's cache line only when it must.
 *   head and tail live on separate 128-byte lines (adjacent-line prefetch), as
 *   do the two sleep words, so the two sides never false-share.
 *
 * WAKE-UPS (no lost wake-up)
 *
 *   A side that must wait first spins (spin_ns), then sleeps: it stores 1 to its
 *   sleep word (cons_sleep for the consumer, prod_sleep for the producer; a
 *   doorbell's `sleeping` for a doorbell consumer), issues a SEQ_CST fence,
 *   re-checks the ring, and only then calls FUTEX_WAIT(word, 1).
 *   The other side, after publishing (tail or head store), issues a SEQ_CST
 *   fence and loads the sleep word; if it is 1 it exchanges it to 0 and calls
 *   FUTEX_WAKE. This is Dekker's pattern: with both fences, either the waiter's
 *   re-check sees the publication (it does not sleep) or the publisher's load
 *   sees the 1 (it wakes). If the publisher's exchange to 0 lands before the
 *   waiter reaches FUTEX_WAIT, the kernel's atomic value check (word != 1)
 *   returns EAGAIN at once, so the wake cannot fall between check and sleep.
 *   Futex words are shared (no FUTEX_PRIVATE_FLAG): the processes map the same
 *   file at different addresses and the kernel keys the futex by inode+offset.
 *   A woken waiter always re-checks the ring (the futex syscalls are full
 *   barriers), so an early or spurious wake costs one loop, never a descriptor.
 *   Doorbell: the same protocol on its `sleeping` word, where the waiter's
 *   re-check covers every ring bound to it; producers of those rings test the
 *   doorbell's word after the same fence as their own ring's. Doorbell `pending`
 *   makes an explicit ring sticky for a waiter that was not asleep.
 *
 * LIVENESS
 *
 *   Each end (producer, consumer; a doorbell's owner) records pid, process start
 *   time (/proc/<pid>/stat field 22, so a reused pid is not mistaken for the
 *   peer) and state (NONE, ATTACHED, CLOSED) under a seqlock generation (odd
 *   while being rewritten, +2 per claim or release): CLOSED ->
 *   HPKV_RING_EPEER_CLOSED, ATTACHED but not running (dead or zombie) ->
 *   HPKV_RING_EPEER_DEAD. Descriptors already in the ring are always delivered
 *   before a dead or closed peer is reported. A sleeping waiter learns of a
 *   death in one of two ways:
 *
 *   Death notices (the usual way; no timer while sleeping). When a thread exits,
 *   the kernel marks every futex word on its robust list (set_robust_list(2))
 *   that holds its TID with FUTEX_OWNER_DIED and wakes a waiter on it if
 *   FUTEX_WAITERS is set. Each ring end has such a `life` word (prod_life,
 *   cons_life). A process's held ends are on the robust list of one "keeper"
 *   thread hpkv starts in it, which only sleeps, every signal blocked, so the
 *   list is processed when the process dies, not when the thread that attached
 *   an end exits. Claiming an end stores the keeper's TID in its life word inside
 *   the end's seqlock window; a clean release unlinks the entry, then zeroes the
 *   word and wakes its waiter (the end already reads CLOSED). The list entries
 *   are in the shared file beside their words (the kernel reads word = entry +
 *   futex_offset); links are written only by the holding process, each a single
 *   pointer store, with list_op_pending covering the entry being linked or
 *   unlinked, so a death at any instant leaves a list the kernel can walk; an
 *   entry is unlinked before its file is unmapped.
 *   The waiter then sleeps on the PEER'S life word instead of its own sleep word:
 *   it announces by setting FUTEX_WAITERS there (a CAS, then the SEQ_CST fence),
 *   re-checks the ring, and calls FUTEX_WAIT(life, TID | FUTEX_WAITERS). The
 *   publisher, after its fence, sees FUTEX_WAITERS and clears it and wakes in one
 *   FUTEX_WAKE_OP: the same Dekker argument as above, with the kernel's value
 *   check covering the race between announcement and sleep, and no window in
 *   which a killed publisher leaves the bit cleared but the waiter asleep. A
 *   publication, a release or the peer's death wakes it; the only timer is the
 *   caller's own deadline (slices cost ≈ 0.5 µs of timer per sleep on this VM, a
 *   tenth of a same-vCPU round trip, and noticed a death only when one ended).
 *   Backstop: a notice can still be missed in rare races at the peer's death (a
 *   thread of it claiming an end while its keeper is already being torn down),
 *   so a watched sleep registers with its own process's keeper, whose watchdog
 *   re-checks the peers of registered sleepers once a second and wakes those
 *   whose peer is gone. Only a process whose keeper runs sleeps this way.
 *
 *   Slices (fallback: the peer holds its end without a keeper, i.e. it is not
 *   attached yet, notices are switched off there, thread creation failed, or it
 *   holds LIFE_MAX ends, below the kernel's 2048-entry walk limit; or no keeper
 *   runs in the waiter's process). The waiter sleeps on its own sleep word at
 *   most slice_ns at a time; when a slice ends without progress it reads the
 *   peer's state and /proc.
 */
#define _GNU_SOURCE
#include "ring.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define HPKV_RING_MAGIC 0x31474e49524b5048ULL /* "HPKRING1" */
#define HPKV_BELL_MAGIC 0x314c4c45424b5048ULL /* "HPKBELL1" */
#define HPKV_HDR_SIZE 4096u
#define HPKV_LINE 128 /* two cache lines: keeps the adjacent-line prefetcher from pairing them */
#define HPKV_MAX_CAPACITY (1u << 24)
#define HPKV_DEFAULT_SPIN_NS                                                                       \
    50000LL /* ≈ one cross-vCPU wake-up on this VM: spin no longer than sleeping costs */
#define HPKV_DEFAULT_SLICE_NS                                                                      \
    50000000LL /* 50 ms: how late a dead peer is noticed without death notices */
#define LIFE_MAX                                                                                   \
    1024 /* ends on one keeper's robust list (the kernel walks at most ROBUST_LIST_LIMIT, 2048) */

/* ------------------------------------------------------------------ layout */

/* One end's identity. Written only by the process holding (or taking) the end. */
struct hpkv_shm_end {
    _Atomic uint32_t gen;   /* seqlock: odd while rewritten */
    _Atomic uint32_t state; /* enum hpkv_end_state */
    _Atomic int32_t pid;
    uint32_t _pad;
    _Atomic uint64_t start_time;
};

/* A robust-list entry in the shared file: the holder's keeper TID (FUTEX_OWNER_DIED once it died),
 * 0 when nobody holds the end through a keeper. `link` is a pointer of the holding process. */
struct hpkv_life {
    struct robust_list link;
    _Atomic uint32_t word;
    uint32_t _pad;
};

/* First bytes of every ring and doorbell file (hpkv_shm_probe reads only these). */
struct hpkv_shm_prefix {
    uint64_t magic;
    uint32_t version;
    uint32_t desc_size;
    uint64_t file_size;
    int32_t creator_pid;
    uint32_t creator_role; /* which end the creator holds (index into ends) */
    uint64_t creator_start;
};

struct hpkv_ring_hdr {
    alignas(HPKV_LINE) struct hpkv_shm_prefix pre;
    uint32_t capacity;
    uint32_t _pad0;
    uint64_t data_offset;
    char doorbell_name[64];
    alignas(HPKV_LINE) struct hpkv_shm_end end[2]; /* [HPKV_RING_PRODUCER], [HPKV_RING_CONSUMER] */
    alignas(HPKV_LINE) _Atomic uint64_t tail;      /* producer-owned */
    alignas(HPKV_LINE) _Atomic uint64_t head;      /* consumer-owned */
    /* Each side's two sleep words share a line with what its waker checks after a publication. */
    alignas(HPKV_LINE) _Atomic uint32_t cons_sleep; /* 1: consumer is (about to be) in FUTEX_WAIT */
    struct hpkv_life prod_life; /* the producer's life word: the consumer sleeps on it */
    alignas(HPKV_LINE) _Atomic uint32_t prod_sleep; /* 1: producer is (about to be) in FUTEX_WAIT */
    struct hpkv_life cons_life; /* the consumer's life word: the producer sleeps on it */
};

static inline struct hpkv_life *life_of(struct hpkv_ring_hdr *h, int role)
{
    return role == HPKV_RING_PRODUCER ? &h->prod_life : &h->cons_life;
}

struct hpkv_bell_hdr {
    alignas(HPKV_LINE) struct hpkv_shm_prefix pre;
    alignas(HPKV_LINE) struct hpkv_shm_end end[1]; /* the owner (consumer) */
    alignas(HPKV_LINE) _Atomic uint32_t sleeping;  /* 1: owner is (about to be) in FUTEX_WAIT */
    alignas(HPKV_LINE) _Atomic uint32_t pending;   /* 1: rung by hpkv_doorbell_ring, not yet seen */
};

_Static_assert(sizeof(struct hpkv_ring_hdr) <= HPKV_HDR_SIZE, "ring header exceeds its page");
_Static_assert(sizeof(struct hpkv_bell_hdr) <= HPKV_HDR_SIZE, "doorbell header exceeds its page");
_Static_assert(offsetof(struct hpkv_ring_hdr, pre) == 0, "prefix first");
_Static_assert(offsetof(struct hpkv_bell_hdr, pre) == 0, "prefix first");

struct hpkv_ring {
    struct hpkv_ring_hdr *h;
    hpkv_desc *slots;
    size_t map_size;
    uint64_t cap, mask;
    int role;
    uint64_t mine;   /* producer: its tail; consumer: its head (it is the only writer) */
    uint64_t theirs; /* cached copy of the other side's counter */
    int64_t spin_ns, slice_ns;
    hpkv_doorbell *bell; /* producer: rung after each push when its owner sleeps */
    int32_t my_pid;
    uint64_t my_start;
    uint32_t my_gen;
    int last_err;
    int64_t deadline; /* of the current blocking call (a NAN timeout continues it) */
    uint64_t sleeps, wakes;
    _Atomic int peer_gone; /* set by the keeper's watchdog for a watched sleep: HPKV_RING_EPEER_* */
};

struct hpkv_doorbell {
    struct hpkv_bell_hdr *h;
    size_t map_size;
    int owner; /* this handle created it (is the consumer) */
    int64_t spin_ns;
    int32_t my_pid;
    uint64_t my_start;
    uint32_t my_gen;
    int64_t deadline; /* of the current wait (a NAN timeout continues it) */
    uint64_t sleeps, wakes;
};

/* ------------------------------------------------------------------ helpers */

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Sleeps while *word == val, at most ns (< 0: no limit). 0 woken, -EAGAIN, -ETIMEDOUT, -EINTR. */
static long futex_wait(_Atomic uint32_t *word, uint32_t val, int64_t ns)
{
    struct timespec ts = {.tv_sec = ns / 1000000000LL, .tv_nsec = ns % 1000000000LL};
    /* Shared futex (no FUTEX_PRIVATE_FLAG): the word is in a MAP_SHARED file. */
    long rc = syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, val, ns < 0 ? NULL : &ts, NULL, 0);
    return rc == 0 ? 0 : -errno;
}

static void futex_wake(_Atomic uint32_t *word, int n)
{
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, n, NULL, NULL, 0);
}

/* Publisher side of the protocol: the caller already fenced (SEQ_CST). */
static inline int wake_if_sleeping(_Atomic uint32_t *word)
{
    /* relaxed: ordering comes from the caller's fence; the load filters the common no-sleeper case
     * so the line is not written on every push. */
    if (atomic_load_explicit(word, memory_order_relaxed) == 0)
        return 0;
    /* relaxed: only one publisher may issue the wake; the sleeper re-checks the ring after it. */
    if (atomic_exchange_explicit(word, 0, memory_order_relaxed) == 0)
        return 0;
    futex_wake(word, 1);
    return 1;
}

/* ------------------------------------------------------------------ death notices (keeper) */

enum { KEEPER_NONE, KEEPER_RUNNING, KEEPER_UNAVAILABLE };

#define SLEEPERS_MAX 256 /* watched sleeps at once in one process; beyond, a sleep uses slices */
#define WATCHDOG_NS 1000000000LL /* the keeper re-checks the peers of watched sleepers this often */

/* Watched sleepers of this process (the keeper's watchdog backs up the kernel's death notice:
 * should a notice be missed, e.g. a holder killed while claiming an end, a watched sleep still ends). */
static struct {
    pthread_mutex_t lock;
    int n;
    hpkv_ring *ring[SLEEPERS_MAX];
} sleepers = {.lock = PTHREAD_MUTEX_INITIALIZER};

static struct {
    pthread_mutex_t lock; /* guards everything below and the list links of our entries */
    _Atomic int state;    /* KEEPER_*; fork_child resets it: a forked child starts over */
    int entries;          /* ends on the list (at most LIFE_MAX) */
    _Atomic int32_t tid;  /* the keeper thread's TID; -1 if it could not register its list */
    struct robust_list_head head; /* the keeper's robust list: our held ends' life words */
} keeper = {.lock = PTHREAD_MUTEX_INITIALIZER};

static _Atomic int notices_enabled = 1; /* hpkv_ring_set_death_notices */

static void keeper_lock(void)
{
    pthread_mutex_lock(&keeper.lock);
}
static void keeper_unlock(void)
{
    pthread_mutex_unlock(&keeper.lock);
}
static void fork_prepare(void)
{
    keeper_lock();
    pthread_mutex_lock(&sleepers.lock);
}
static void fork_parent(void)
{
    pthread_mutex_unlock(&sleepers.lock);
    keeper_unlock();
}
static void fork_child(void)
{
    /* The child has no keeper thread (threads do not survive fork); it starts its own when it
     * claims an end. The entries it inherited belong to the parent: never touch them. */
    pthread_mutex_init(&keeper.lock, NULL);
    pthread_mutex_init(&sleepers.lock, NULL);
    atomic_store_explicit(&keeper.state, KEEPER_NONE,
                          memory_order_relaxed); /* relaxed: one thread here */
    sleepers.n = 0;
}
static void keeper_register_atfork(void)
{
    pthread_atfork(fork_prepare, fork_parent, fork_child);
}

/* 1 if this process's keeper runs: only then may a sleep rely on the life word (the watchdog). */
static inline int keeper_here(void)
{
    /* relaxed: set once per process (and reset in a forked child before it runs anything). */
    return atomic_load_explicit(&keeper.state, memory_order_relaxed) == KEEPER_RUNNING;
}

static int end_status(const struct hpkv_shm_end *e);

/* The keeper's watchdog: once a second, wakes every watched sleeper whose peer is gone. */
static void watchdog_scan(void)
{
    pthread_mutex_lock(&sleepers.lock);
    for (int i = 0; i < sleepers.n; i++) {
        hpkv_ring *r = sleepers.ring[i];
        int st = end_status(&r->h->end[r->role ^ 1]);
        if (st == 0)
            continue;
        atomic_store_explicit(&r->peer_gone, st,
                              memory_order_release); /* release: before the wake */
        futex_wake(&life_of(r->h, r->role ^ 1)->word, INT_MAX);
    }
    pthread_mutex_unlock(&sleepers.lock);
}

/* A watched sleep registers (0 when the registry is full: sleep in slices instead). */
static int sleeper_add(hpkv_ring *r)
{
    pthread_mutex_lock(&sleepers.lock);
    int ok = sleepers.n < SLEEPERS_MAX;
    if (ok)
        sleepers.ring[sleepers.n++] = r;
    pthread_mutex_unlock(&sleepers.lock);
    return ok;
}

static void sleeper_remove(hpkv_ring *r)
{
    pthread_mutex_lock(&sleepers.lock);
    for (int i = 0; i < sleepers.n; i++) {
        if (sleepers.ring[i] == r) {
            sleepers.ring[i] = sleepers.ring[--sleepers.n];
            break;
        }
    }
    pthread_mutex_unlock(&sleepers.lock);
}

static void *keeper_main(void *arg)
{
    (void)arg;
    int32_t tid = (int32_t)syscall(SYS_gettid);
    long rc = syscall(SYS_set_robust_list, &keeper.head, sizeof keeper.head);
    /* release: the starter reads the head we registered after it sees the TID. */
    atomic_store_explicit(&keeper.tid, rc == 0 ? tid : -1, memory_order_release);
    if (rc != 0)
        return NULL;
    for (;;) { /* every signal is blocked in this thread: it lives until the process dies */
        struct timespec tick = {WATCHDOG_NS / 1000000000LL, WATCHDOG_NS % 1000000000LL};
        nanosleep(&tick, NULL);
        watchdog_scan();
    }
    return NULL;
}

/* Starts this process's keeper once (caller holds keeper.lock). 1 if it is running. */
static int keeper_running_locked(void)
{
    if (keeper.state != KEEPER_NONE)
        return keeper_here();
    atomic_store_explicit(&keeper.state, KEEPER_UNAVAILABLE,
                          memory_order_relaxed); /* relaxed: under lock */
    keeper.entries = 0;
    keeper.head.list.next = &keeper.head.list;
    keeper.head.futex_offset = offsetof(struct hpkv_life, word) - offsetof(struct hpkv_life, link);
    keeper.head.list_op_pending = NULL;
    atomic_store_explicit(&keeper.tid, 0,
                          memory_order_relaxed); /* relaxed: no thread reads it yet */
    pthread_attr_t attr;
    if (pthread_attr_init(&attr) != 0)
        return 0;
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 64 * 1024 > PTHREAD_STACK_MIN ? 64 * 1024 : PTHREAD_STACK_MIN);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* the keeper inherits "everything blocked" */
    pthread_t thread;
    int rc = pthread_create(&thread, &attr, keeper_main, NULL);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (rc != 0)
        return 0;
    for (int i = 0; i < 20000; i++) { /* ≈ 2 s at most; a new thread registers in microseconds */
        /* acquire: pairs with the keeper's release store. */
        int32_t tid = atomic_load_explicit(&keeper.tid, memory_order_acquire);
        if (tid != 0) {
            /* relaxed: a flag; the TID and list were published by the acquire above. */
            if (tid > 0)
                atomic_store_explicit(&keeper.state, KEEPER_RUNNING, memory_order_relaxed);
            break;
        }
        struct timespec pause_100us = {0, 100000};
        nanosleep(&pause_100us, NULL);
    }
    return keeper_here();
}

/* Makes sure this process has a keeper before an end is claimed (thread start is slow: not
 * inside the end's seqlock window). */
static void keeper_start(void)
{
    if (!atomic_load_explicit(&notices_enabled, memory_order_relaxed))
        return; /* relaxed: a switch */
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, keeper_register_atfork); /* before any fork can copy a held lock */
    keeper_lock();
    keeper_running_locked();
    keeper_unlock();
}

/* Inside an end's claim window: the end's life word gets our keeper's TID and the entry joins the
 * keeper's list; without a keeper (or with LIFE_MAX entries) the word is 0: peers use slices. */
static void life_claim(struct hpkv_life *l)
{
    keeper_lock();
    uint32_t word = 0;
    if (keeper_here() && keeper.entries < LIFE_MAX &&
        atomic_load_explicit(&notices_enabled, memory_order_relaxed)) { /* relaxed: a switch */
        /* relaxed: the keeper's TID was published to us when it started. */
        word = (uint32_t)atomic_load_explicit(&keeper.tid, memory_order_relaxed);
        /* The kernel reads these links only when this process dies, possibly from another CPU while a
         * thread of ours is mid-update: each is one release store, and list_op_pending covers the entry. */
        __atomic_store_n(&keeper.head.list_op_pending, &l->link, __ATOMIC_RELEASE);
        __atomic_store_n(&l->link.next, keeper.head.list.next, __ATOMIC_RELEASE);
    }
    /* acq_rel: replaces a dead predecessor's OWNER_DIED, so nobody takes us for it; a waiter still
     * announced on the old value is woken to look again. */
    uint32_t old = atomic_exchange_explicit(&l->word, word, memory_order_acq_rel);
    if (word) {
        __atomic_store_n(&keeper.head.list.next, &l->link, __ATOMIC_RELEASE);
        __atomic_store_n(&keeper.head.list_op_pending, NULL, __ATOMIC_RELEASE);
        keeper.entries++;
    }
    keeper_unlock();
    if (old & FUTEX_WAITERS)
        futex_wake(&l->word, INT_MAX);
}

/* First step of a release, before the end is marked CLOSED (after that, another process may claim
 * the end and rewrite the entry's link): take our entry off the keeper's list. */
static void life_unlink(struct hpkv_life *l)
{
    keeper_lock();
    if (keeper_here()) {
        struct robust_list *prev = &keeper.head.list;
        while (prev->next != &keeper.head.list && prev->next != &l->link)
            prev = prev->next;
        if (prev->next == &l->link) {
            __atomic_store_n(&keeper.head.list_op_pending, &l->link, __ATOMIC_RELEASE);
            __atomic_store_n(&prev->next, l->link.next, __ATOMIC_RELEASE);
            __atomic_store_n(&keeper.head.list_op_pending, NULL, __ATOMIC_RELEASE);
            keeper.entries--;
        }
    }
    keeper_unlock();
}

/* Second step, once the end reads CLOSED: zero the word if it still holds our keeper's TID (a
 * successor may already have claimed the end) and wake the peer announced on it. */
static void life_clear(struct hpkv_life *l)
{
    if (!keeper_here())
        return;
    uint32_t mine =
        (uint32_t)atomic_load_explicit(&keeper.tid, memory_order_relaxed); /* relaxed: ours */
    /* acquire: a failed CAS re-reads; acq_rel: the CLOSED state published before stays before it. */
    uint32_t w = atomic_load_explicit(&l->word, memory_order_acquire);
    while ((w & FUTEX_TID_MASK) == mine &&
           !atomic_compare_exchange_weak_explicit(&l->word, &w, 0, memory_order_acq_rel,
                                                  memory_order_acquire)) {
    }
    if ((w & FUTEX_TID_MASK) == mine && (w & FUTEX_WAITERS))
        futex_wake(&l->word, INT_MAX);
}

/* Waiter, on the peer's life word: announce sleep by setting FUTEX_WAITERS (the kernel wakes such a
 * word's waiter when its holder dies). 1: announced, *val is the value to sleep on; 0: unusable
 * (no keeper holds the peer's end, or none runs here to back the sleep up: use the sleep word and
 * slices); -1: the peer died. */
static int life_announce(struct hpkv_life *l, uint32_t *val)
{
    uint32_t v =
        atomic_load_explicit(&l->word, memory_order_relaxed); /* relaxed: the CAS decides */
    int here = keeper_here();
    for (;;) {
        if (v & FUTEX_OWNER_DIED)
            return -1;
        if ((v & FUTEX_TID_MASK) == 0 || !here)
            return 0;
        /* seq_cst: the announcement is ordered before the re-check of the ring (Dekker, see top). */
        if (atomic_compare_exchange_weak_explicit(&l->word, &v, v | FUTEX_WAITERS,
                                                  memory_order_seq_cst, memory_order_relaxed)) {
            *val = v | FUTEX_WAITERS;
            return 1;
        }
    }
}

/* Waiter, returning without having been woken: withdraw the announcement (saves the holder a wake). */
static inline void life_withdraw(struct hpkv_life *l)
{
    /* relaxed: only a hint to the holder; its own RMW decides whether it wakes. */
    atomic_fetch_and_explicit(&l->word, ~(uint32_t)FUTEX_WAITERS, memory_order_relaxed);
}

/* Holder, after a publication and the caller's SEQ_CST fence: wake a waiter announced on our word.
 * FUTEX_WAKE_OP clears FUTEX_WAITERS and wakes in one syscall, under the futex bucket lock: a waiter
 * not yet asleep then fails its value check (no lost wake-up), and a holder killed between the two
 * halves cannot leave the waiter asleep with the bit cleared (the kernel's death notice wakes only
 * while the bit is set). */
static inline int life_wake(struct hpkv_life *l)
{
    /* relaxed: ordering comes from the caller's fence; the load filters the common no-waiter case. */
    if (!(atomic_load_explicit(&l->word, memory_order_relaxed) & FUTEX_WAITERS))
        return 0;
    /* *word &= ~(1 << 31), i.e. ~FUTEX_WAITERS; then wake 1 waiter on it (nr_wake2 0: no second wake). */
    syscall(SYS_futex, (uint32_t *)&l->word, FUTEX_WAKE_OP, 1, (void *)0, (uint32_t *)&l->word,
            FUTEX_OP((FUTEX_OP_ANDN | FUTEX_OP_OPARG_SHIFT), 31, FUTEX_OP_CMP_EQ, 0));
    return 1;
}

size_t hpkv_ring_life_offset(int role)
{
    return role == HPKV_RING_PRODUCER ? offsetof(struct hpkv_ring_hdr, prod_life.word)
                                      : offsetof(struct hpkv_ring_hdr, cons_life.word);
}

void hpkv_ring_set_death_notices(int enabled)
{
    atomic_store_explicit(&notices_enabled, enabled != 0,
                          memory_order_relaxed); /* relaxed: a switch */
}

uint64_t hpkv_proc_start_time(int32_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    /* comm (field 2) may contain spaces and ')': fields resume after the last ')'. */
    char *p = strrchr(buf, ')');
    if (!p || p[1] != ' ')
        return 0;
    p += 2;
    char state = *p;
    if (state == 'Z' || state == 'X')
        return 0;                              /* killed, not yet reaped: dead for us */
    for (int field = 3; field < 22; field++) { /* p is at field 3 */
        p = strchr(p, ' ');
        if (!p)
            return 0;
        p++;
    }
    return strtoull(p, NULL, 10);
}

int hpkv_proc_alive(int32_t pid, uint64_t start_time)
{
    if (pid <= 0)
        return 0;
    uint64_t st = hpkv_proc_start_time(pid);
    if (st != 0)
        return start_time == 0 || st == start_time;
    /* No readable /proc entry: dead, unless /proc is hidden from us (then ask kill). */
    if (access("/proc/self/stat", R_OK) == 0)
        return 0;
    return kill(pid, 0) == 0 || errno == EPERM;
}

/* Seqlock read of an end: consistent (state, pid, start, gen). */
static void end_read(const struct hpkv_shm_end *ce, uint32_t *state, int32_t *pid, uint64_t *start,
                     uint32_t *gen)
{
    struct hpkv_shm_end *e = (struct hpkv_shm_end *)ce;
    for (;;) {
        /* acquire: the field loads below must not move above the generation read. */
        uint32_t g1 = atomic_load_explicit(&e->gen, memory_order_acquire);
        if (g1 & 1) {
            cpu_relax();
            continue;
        }
        uint32_t s = atomic_load_explicit(&e->state, memory_order_relaxed);
        int32_t p = atomic_load_explicit(&e->pid, memory_order_relaxed);
        uint64_t t = atomic_load_explicit(&e->start_time, memory_order_relaxed);
        /* acquire fence: field loads complete before the re-read of gen (seqlock reader). */
        atomic_thread_fence(memory_order_acquire);
        if (atomic_load_explicit(&e->gen, memory_order_relaxed) != g1)
            continue;
        if (state)
            *state = s;
        if (pid)
            *pid = p;
        if (start)
            *start = t;
        if (gen)
            *gen = g1;
        return;
    }
}

/* Takes an end for (pid, start), and its life word when there is one (rings, not doorbells).
 * Fails with HPKV_RING_EBUSY if a live process holds it. */
static int end_claim(struct hpkv_shm_end *e, struct hpkv_life *life, int32_t pid, uint64_t start,
                     uint32_t *gen_out)
{
    for (int tries = 0; tries < 1000; tries++) {
        uint32_t state, g;
        int32_t p;
        uint64_t t;
        end_read(e, &state, &p, &t, &g);
        if (state == HPKV_END_ATTACHED && hpkv_proc_alive(p, t))
            return HPKV_RING_EBUSY;
        /* acq_rel: wins the right to rewrite the end; later field stores stay after it. */
        if (!atomic_compare_exchange_strong_explicit(&e->gen, &g, g + 1, memory_order_acq_rel,
                                                     memory_order_relaxed))
            continue; /* another process is claiming it right now: re-read */
        /* relaxed: inside the odd-generation window; the release below publishes them. */
        atomic_store_explicit(&e->pid, pid, memory_order_relaxed);
        atomic_store_explicit(&e->start_time, start, memory_order_relaxed);
        atomic_store_explicit(&e->state, HPKV_END_ATTACHED, memory_order_relaxed);
        if (life)
            life_claim(life); /* inside the window: no reader pairs our state with a dead TID */
        /* release: readers that see the even generation see the fields above. */
        atomic_store_explicit(&e->gen, g + 2, memory_order_release);
        *gen_out = g + 2;
        return 0;
    }
    return -EAGAIN;
}

/* Marks the end CLOSED, only if it is still ours (a forked child or a process
 * that lost the end to a replacement never closes someone else's end). */
static void end_release(struct hpkv_shm_end *e, int32_t pid, uint64_t start, uint32_t gen)
{
    uint32_t g = gen;
    /* relaxed: only we write our own end; the CAS below catches a concurrent take-over. */
    if (atomic_load_explicit(&e->pid, memory_order_relaxed) != pid ||
        atomic_load_explicit(&e->start_time, memory_order_relaxed) != start)
        return;
    /* acq_rel: same seqlock write as end_claim; fails if someone took the end since. */
    if (!atomic_compare_exchange_strong_explicit(&e->gen, &g, g + 1, memory_order_acq_rel,
                                                 memory_order_relaxed))
        return;
    atomic_store_explicit(&e->state, HPKV_END_CLOSED,
                          memory_order_relaxed); /* relaxed: odd window */
    /* release: publish the CLOSED state with the new even generation. */
    atomic_store_explicit(&e->gen, g + 2, memory_order_release);
}

/* 0: peer running or not attached yet; else HPKV_RING_EPEER_CLOSED / _DEAD. */
static int end_status(const struct hpkv_shm_end *e)
{
    uint32_t state;
    int32_t pid;
    uint64_t start;
    end_read(e, &state, &pid, &start, NULL);
    if (state == HPKV_END_CLOSED)
        return HPKV_RING_EPEER_CLOSED;
    if (state == HPKV_END_ATTACHED && !hpkv_proc_alive(pid, start))
        return HPKV_RING_EPEER_DEAD;
    return 0;
}

static int end_closed(const struct hpkv_shm_end *e)
{
    /* relaxed: a hint checked before sleeping; end_status gives the consistent answer. */
    return atomic_load_explicit(&((struct hpkv_shm_end *)e)->state, memory_order_relaxed) ==
           HPKV_END_CLOSED;
}

int hpkv_shm_probe(const void *hdr, size_t len, int32_t *creator_pid)
{
    const struct hpkv_shm_prefix *pre = hdr;
    if (len < HPKV_HDR_SIZE)
        return HPKV_RING_EBADFILE;
    int nends;
    const struct hpkv_shm_end *ends;
    if (pre->magic == HPKV_RING_MAGIC) {
        ends = ((const struct hpkv_ring_hdr *)hdr)->end;
        nends = 2;
    } else if (pre->magic == HPKV_BELL_MAGIC) {
        ends = ((const struct hpkv_bell_hdr *)hdr)->end;
        nends = 1;
    } else {
        return HPKV_RING_EBADFILE;
    }
    if (creator_pid)
        *creator_pid = pre->creator_pid;
    if (!hpkv_proc_alive(pre->creator_pid, pre->creator_start))
        return HPKV_PROBE_STALE;
    /* Creator alive: stale only if it released its end (closed without unlinking). */
    if (pre->creator_role < (uint32_t)nends) {
        const struct hpkv_shm_end *e = &ends[pre->creator_role];
        if (e->state == HPKV_END_CLOSED && e->pid == pre->creator_pid)
            return HPKV_PROBE_STALE;
    }
    return HPKV_PROBE_LIVE;
}

int32_t hpkv_shm_end_pid(const void *hdr, size_t len, int role)
{
    const struct hpkv_shm_prefix *pre = hdr;
    if (len < HPKV_HDR_SIZE || role < 0)
        return -1;
    if (pre->magic == HPKV_RING_MAGIC && role < 2)
        return ((const struct hpkv_ring_hdr *)hdr)->end[role].pid;
    if (pre->magic == HPKV_BELL_MAGIC && role < 1)
        return ((const struct hpkv_bell_hdr *)hdr)->end[role].pid;
    return -1;
}

size_t hpkv_ring_file_size(uint32_t capacity)
{
    return HPKV_HDR_SIZE + (size_t)capacity * sizeof(hpkv_desc);
}

size_t hpkv_doorbell_file_size(void)
{
    return HPKV_HDR_SIZE;
}

/* Sizes the file (create), maps it populated, returns the mapping or NULL (*err). */
static void *map_file(int fd, int create, size_t want, size_t *size_out, int *err)
{
    size_t size = want;
    if (create) {
        int rc = posix_fallocate(fd, 0, (off_t)size); /* returns the error, does not set errno */
        if (rc != 0) {
            *err = -rc;
            return NULL;
        }
    } else {
        struct stat st;
        if (fstat(fd, &st) != 0) {
            *err = -errno;
            return NULL;
        }
        if ((size_t)st.st_size < HPKV_HDR_SIZE) {
            *err = HPKV_RING_EBADFILE;
            return NULL;
        }
        size = (size_t)st.st_size;
    }
    /* MAP_POPULATE: faults cost ≈ 2 µs per page here; take them now, not on the first push. */
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (p == MAP_FAILED) {
        *err = -errno;
        return NULL;
    }
    *size_out = size;
    return p;
}

static void prefix_init(struct hpkv_shm_prefix *pre, uint64_t magic, size_t size, int32_t pid,
                        uint64_t start, uint32_t role)
{
    pre->magic = magic;
    pre->version = HPKV_RING_VERSION;
    pre->desc_size = sizeof(hpkv_desc);
    pre->file_size = size;
    pre->creator_pid = pid;
    pre->creator_role = role;
    pre->creator_start = start;
}

static int prefix_check(const struct hpkv_shm_prefix *pre, uint64_t magic, size_t size)
{
    if (pre->magic != magic)
        return HPKV_RING_EBADFILE;
    if (pre->version != HPKV_RING_VERSION || pre->desc_size != sizeof(hpkv_desc))
        return HPKV_RING_EVERSION;
    if (pre->file_size != size)
        return HPKV_RING_EBADFILE;
    return 0;
}

/* ------------------------------------------------------------------ ring */

hpkv_ring *hpkv_ring_map(int fd, int role, int create, uint32_t capacity, int *err)
{
    *err = 0;
    if (role != HPKV_RING_PRODUCER && role != HPKV_RING_CONSUMER) {
        *err = -EINVAL;
        return NULL;
    }
    if (create && (capacity < 2 || capacity > HPKV_MAX_CAPACITY || (capacity & (capacity - 1)))) {
        *err = HPKV_RING_ECAPACITY;
        return NULL;
    }
    size_t size = 0;
    void *base = map_file(fd, create, hpkv_ring_file_size(capacity), &size, err);
    if (!base)
        return NULL;
    struct hpkv_ring_hdr *h = base;
    int32_t pid = (int32_t)getpid();
    uint64_t start = hpkv_proc_start_time(pid);
    if (create) {
        /* Nobody else sees the file before the caller renames it into place. */
        memset(h, 0, sizeof *h);
        prefix_init(&h->pre, HPKV_RING_MAGIC, size, pid, start, (uint32_t)role);
        h->capacity = capacity;
        h->data_offset = HPKV_HDR_SIZE;
    } else {
        int rc = prefix_check(&h->pre, HPKV_RING_MAGIC, size);
        if (rc == 0 &&
            (h->capacity < 2 || (h->capacity & (h->capacity - 1)) ||
             hpkv_ring_file_size(h->capacity) != size || h->data_offset != HPKV_HDR_SIZE))
            rc = HPKV_RING_EBADFILE;
        if (rc) {
            munmap(base, size);
            *err = rc;
            return NULL;
        }
    }
    hpkv_ring *r = calloc(1, sizeof *r);
    if (!r) {
        munmap(base, size);
        *err = -ENOMEM;
        return NULL;
    }
    keeper_start();
    int rc = end_claim(&h->end[role], life_of(h, role), pid, start, &r->my_gen);
    if (rc) {
        munmap(base, size);
        free(r);
        *err = rc;
        return NULL;
    }
    r->h = h;
    r->slots = (hpkv_desc *)((char *)base + h->data_offset);
    r->map_size = size;
    r->cap = h->capacity;
    r->mask = h->capacity - 1;
    r->role = role;
    r->my_pid = pid;
    r->my_start = start;
    r->spin_ns = HPKV_DEFAULT_SPIN_NS;
    r->slice_ns = HPKV_DEFAULT_SLICE_NS;
    /* acquire: a re-attaching end continues from the counters its predecessor published. */
    uint64_t head = atomic_load_explicit(&h->head, memory_order_acquire);
    uint64_t tail = atomic_load_explicit(&h->tail, memory_order_acquire);
    r->mine = role == HPKV_RING_PRODUCER ? tail : head;
    r->theirs = role == HPKV_RING_PRODUCER ? head : tail;
    return r;
}

void hpkv_ring_unmap(hpkv_ring *r)
{
    if (!r)
        return;
    life_unlink(life_of(r->h, r->role)); /* before CLOSED (a successor rewrites it) and the unmap */
    end_release(&r->h->end[r->role], r->my_pid, r->my_start, r->my_gen);
    life_clear(life_of(r->h, r->role));
    /* The peer may be asleep waiting for us: wake it so it sees CLOSED now, not after a slice. */
    atomic_thread_fence(memory_order_seq_cst); /* seq_cst: same Dekker pairing as a publication */
    wake_if_sleeping(r->role == HPKV_RING_PRODUCER ? &r->h->cons_sleep : &r->h->prod_sleep);
    if (r->bell && r->role == HPKV_RING_PRODUCER)
        hpkv_doorbell_ring(r->bell);
    munmap(r->h, r->map_size);
    free(r);
}

static inline void notify_consumer(hpkv_ring *r)
{
    /* seq_cst: orders our tail store before the sleep-word loads (Dekker, see top). */
    atomic_thread_fence(memory_order_seq_cst);
    r->wakes += wake_if_sleeping(&r->h->cons_sleep) + life_wake(&r->h->prod_life);
    if (r->bell)
        r->wakes += wake_if_sleeping(&r->bell->h->sleeping);
}

static inline void notify_producer(hpkv_ring *r)
{
    /* seq_cst: orders our head store before the producer's sleep-word load (Dekker). */
    atomic_thread_fence(memory_order_seq_cst);
    r->wakes += wake_if_sleeping(&r->h->prod_sleep) + life_wake(&r->h->cons_life);
}

static inline uint32_t push_n(hpkv_ring *r, const hpkv_desc *src, uint32_t n)
{
    uint64_t tail = r->mine;
    uint64_t room = r->cap - (tail - r->theirs);
    if (room < n) {
        /* acquire: pairs with the consumer's release of head; its reads of these slots are done. */
        r->theirs = atomic_load_explicit(&r->h->head, memory_order_acquire);
        room = r->cap - (tail - r->theirs);
    }
    if (n > room)
        n = (uint32_t)room;
    if (n == 0)
        return 0;
    uint64_t i = tail & r->mask;
    uint64_t first = r->cap - i < n ? r->cap - i : n; /* up to the end of the array, then wrap */
    memcpy(&r->slots[i], src, first * sizeof *src);
    if (first < n)
        memcpy(&r->slots[0], src + first, (n - first) * sizeof *src);
    r->mine = tail + n;
    /* release: the slot contents above become visible before the new tail. */
    atomic_store_explicit(&r->h->tail, tail + n, memory_order_release);
    notify_consumer(r);
    return n;
}

static inline uint32_t pop_n(hpkv_ring *r, hpkv_desc *dst, uint32_t n)
{
    uint64_t head = r->mine;
    uint64_t avail = r->theirs - head;
    if (avail < n) {
        /* acquire: pairs with the producer's release of tail; slots up to it are filled. */
        r->theirs = atomic_load_explicit(&r->h->tail, memory_order_acquire);
        avail = r->theirs - head;
    }
    if (n > avail)
        n = (uint32_t)avail;
    if (n == 0)
        return 0;
    uint64_t i = head & r->mask;
    uint64_t first = r->cap - i < n ? r->cap - i : n;
    memcpy(dst, &r->slots[i], first * sizeof *dst);
    if (first < n)
        memcpy(dst + first, &r->slots[0], (n - first) * sizeof *dst);
    r->mine = head + n;
    /* release: our reads of the slots complete before the producer may reuse them. */
    atomic_store_explicit(&r->h->head, head + n, memory_order_release);
    notify_producer(r);
    return n;
}

uint32_t hpkv_ring_try_push(hpkv_ring *r, const hpkv_desc *src, uint32_t n)
{
    return r->role == HPKV_RING_PRODUCER ? push_n(r, src, n) : 0;
}

uint32_t hpkv_ring_try_pop(hpkv_ring *r, hpkv_desc *dst, uint32_t n)
{
    return r->role == HPKV_RING_CONSUMER ? pop_n(r, dst, n) : 0;
}

/* Is there something for this side: producer: room; consumer: a descriptor. */
static inline int ring_ready(hpkv_ring *r)
{
    if (r->role == HPKV_RING_PRODUCER) {
        /* acquire: see push_n. */
        r->theirs = atomic_load_explicit(&r->h->head, memory_order_acquire);
        return r->mine - r->theirs < r->cap;
    }
    /* acquire: see pop_n. */
    r->theirs = atomic_load_explicit(&r->h->tail, memory_order_acquire);
    return r->theirs != r->mine;
}

/* One sleep of ring_wait, announced already (watch: on the peer's life word; else on `word`), for at
 * most `left` ns (INT64_MAX: no limit). 0: look again; else a result for the caller
 * (HPKV_RING_EPEER_*, -EINTR, another -errno). */
static int ring_sleep(hpkv_ring *r, int watch, uint32_t life_val, _Atomic uint32_t *word,
                      int64_t left)
{
    struct hpkv_shm_end *peer = &r->h->end[r->role ^ 1];
    int64_t slice = left < r->slice_ns ? left : r->slice_ns;
    long w;
    r->sleeps++;
    if (watch) {
        /* relaxed: reset before we register; the keeper sets it only while we are registered. */
        atomic_store_explicit(&r->peer_gone, 0, memory_order_relaxed);
        int backed = sleeper_add(r); /* the keeper's watchdog backs the kernel's death notice up */
        int64_t most = backed ? left : slice;
        w = futex_wait(&life_of(r->h, r->role ^ 1)->word, life_val, most == INT64_MAX ? -1 : most);
        if (backed)
            sleeper_remove(r);
        /* acquire: pairs with the keeper's release before its wake. */
        int gone = atomic_exchange_explicit(&r->peer_gone, 0, memory_order_acquire);
        if (gone && !ring_ready(r))
            return gone;
        if (backed && w == -ETIMEDOUT)
            return 0; /* the caller's deadline: ring_wait decides */
    } else {
        w = futex_wait(word, 1, slice);
        atomic_store_explicit(word, 0, memory_order_relaxed); /* relaxed: a hint to publishers */
    }
    if (w == -ETIMEDOUT) {
        /* A whole slice without progress: is the peer still there? (/proc read, ≈ µs) */
        return ring_ready(r) ? 0 : end_status(peer);
    }
    return w == 0 || w == -EAGAIN ? 0 : (int)w; /* woken, or the word moved on: look again */
}

/* Waits until ring_ready or the deadline (INT64_MAX: none). 1 ready, 0 timeout, <0 error. */
static int ring_wait(hpkv_ring *r, int64_t deadline)
{
    if (ring_ready(r))
        return 1;
    int64_t t = now_ns();
    int64_t spin_end = t + r->spin_ns;
    while (t < spin_end && t < deadline) {
        for (int k = 0; k < 64; k++) { /* check the clock every 64 polls (≈ 2 µs) */
            if (ring_ready(r))
                return 1;
            cpu_relax();
        }
        t = now_ns();
    }
    struct hpkv_shm_end *peer = &r->h->end[r->role ^ 1];
    struct hpkv_life *life = life_of(r->h, r->role ^ 1);
    _Atomic uint32_t *word = r->role == HPKV_RING_PRODUCER ? &r->h->prod_sleep : &r->h->cons_sleep;
    for (;;) {
        /* Announce: on the peer's life word when its keeper holds it (woken by its death too), else
         * on our sleep word (relaxed store + the seq_cst fence below: Dekker, see top). */
        uint32_t life_val = 0;
        int watch = life_announce(life, &life_val);
        if (watch == 0)
            atomic_store_explicit(word, 1, memory_order_relaxed);
        atomic_thread_fence(memory_order_seq_cst);
        int rc;
        if (ring_ready(r)) {
            rc = 1;
        } else if (watch < 0) {
            rc = HPKV_RING_EPEER_DEAD; /* the kernel marked the peer's keeper dead */
        } else if (end_closed(peer)) {
            rc = HPKV_RING_EPEER_CLOSED;
        } else {
            int64_t left = deadline == INT64_MAX ? INT64_MAX : deadline - now_ns();
            if (left <= 0) {
                rc = end_status(peer); /* timeout (0), unless the peer is gone: that wins */
            } else if ((rc = ring_sleep(r, watch, life_val, word, left)) == 0) {
                continue;
            }
        }
        if (watch > 0)
            life_withdraw(life);
        else if (watch == 0)
            atomic_store_explicit(word, 0, memory_order_relaxed); /* relaxed: a hint */
        return rc;
    }
}

/* Absolute deadline (INT64_MAX: none) of a blocking call, remembered in *saved for a NAN retry. */
static inline int64_t deadline_of(int64_t *saved, double timeout_s)
{
    if (isnan(timeout_s))
        return *saved;
    if (timeout_s > 1e9)
        return *saved = INT64_MAX; /* +inf, or beyond 31 years: no limit */
    return *saved = now_ns() + (timeout_s > 0 ? (int64_t)(timeout_s * 1e9) : 0);
}

int64_t hpkv_ring_push_wait(hpkv_ring *r, const hpkv_desc *src, uint32_t n, double timeout_s)
{
    r->last_err = 0;
    if (r->role != HPKV_RING_PRODUCER) {
        r->last_err = -EPERM;
        return 0;
    }
    uint32_t done = push_n(r, src, n);
    if (done == n)
        return done;
    int64_t deadline = deadline_of(&r->deadline, timeout_s);
    while (done < n) {
        int rc = ring_wait(r, deadline);
        if (rc <= 0) {
            r->last_err = rc;
            break;
        }
        done += push_n(r, src + done, n - done);
    }
    return done;
}

int64_t hpkv_ring_pop_wait(hpkv_ring *r, hpkv_desc *dst, uint32_t n, double timeout_s)
{
    r->last_err = 0;
    if (r->role != HPKV_RING_CONSUMER)
        return r->last_err = -EPERM;
    if (n == 0)
        return 0;
    uint32_t got = pop_n(r, dst, n);
    if (got)
        return got;
    int64_t deadline = deadline_of(&r->deadline, timeout_s);
    for (;;) {
        int rc = ring_wait(r, deadline);
        if (rc <= 0)
            return r->last_err = rc;
        got = pop_n(r, dst, n);
        if (got)
            return got;
    }
}

int hpkv_ring_last_error(const hpkv_ring *r)
{
    return r->last_err;
}

const struct hpkv_ring_calls *hpkv_ring_call_table(void)
{
    static const struct hpkv_ring_calls table = {
        sizeof table,      HPKV_RING_CALLS_VERSION, hpkv_ring_try_push,   hpkv_ring_push_wait,
        hpkv_ring_try_pop, hpkv_ring_pop_wait,      hpkv_ring_last_error,
    };
    return &table;
}

uint64_t hpkv_ring_depth(const hpkv_ring *r)
{
    /* acquire both: a consistent-enough snapshot for monitoring (head read first so depth >= 0). */
    uint64_t head = atomic_load_explicit(&r->h->head, memory_order_acquire);
    uint64_t tail = atomic_load_explicit(&r->h->tail, memory_order_acquire);
    return tail - head;
}

uint32_t hpkv_ring_capacity(const hpkv_ring *r)
{
    return (uint32_t)r->cap;
}
int hpkv_ring_role(const hpkv_ring *r)
{
    return r->role;
}

void hpkv_ring_set_wait(hpkv_ring *r, int64_t spin_ns, int64_t slice_ns)
{
    r->spin_ns = spin_ns < 0 ? 0 : spin_ns;
    r->slice_ns = slice_ns < 1000000 ? 1000000 : slice_ns; /* ≥ 1 ms: each slice end reads /proc */
}

int hpkv_ring_peer_status(hpkv_ring *r)
{
    return end_status(&r->h->end[r->role ^ 1]);
}

void hpkv_ring_end_info(const hpkv_ring *r, int role, int32_t *pid, uint64_t *start_time,
                        uint32_t *generation, uint32_t *state)
{
    end_read(&r->h->end[role & 1], state, pid, start_time, generation);
}

void hpkv_ring_stats(const hpkv_ring *r, uint64_t *sleeps, uint64_t *wakes)
{
    *sleeps = r->sleeps;
    *wakes = r->wakes;
}

int hpkv_ring_set_doorbell_name(hpkv_ring *r, const char *name)
{
    size_t len = strlen(name);
    if (len >= sizeof r->h->doorbell_name)
        return -ENAMETOOLONG;
    /* Written once, by the side that binds first, before the peer looks for it. */
    memset(r->h->doorbell_name, 0, sizeof r->h->doorbell_name);
    memcpy(r->h->doorbell_name, name, len);
    return 0;
}

int hpkv_ring_get_doorbell_name(const hpkv_ring *r, char *out, size_t out_len)
{
    size_t len = strnlen(r->h->doorbell_name, sizeof r->h->doorbell_name);
    if (len >= out_len)
        return -ENAMETOOLONG;
    memcpy(out, r->h->doorbell_name, len);
    out[len] = 0;
    return (int)len;
}

void hpkv_ring_bind_doorbell(hpkv_ring *r, hpkv_doorbell *b)
{
    r->bell = b;
}

/* ------------------------------------------------------------------ doorbell */

hpkv_doorbell *hpkv_doorbell_map(int fd, int create, int *err)
{
    *err = 0;
    size_t size = 0;
    void *base = map_file(fd, create, HPKV_HDR_SIZE, &size, err);
    if (!base)
        return NULL;
    struct hpkv_bell_hdr *h = base;
    int32_t pid = (int32_t)getpid();
    uint64_t start = hpkv_proc_start_time(pid);
    if (create) {
        memset(h, 0, sizeof *h);
        prefix_init(&h->pre, HPKV_BELL_MAGIC, size, pid, start, 0);
    } else {
        int rc = prefix_check(&h->pre, HPKV_BELL_MAGIC, size);
        if (rc) {
            munmap(base, size);
            *err = rc;
            return NULL;
        }
    }
    hpkv_doorbell *b = calloc(1, sizeof *b);
    if (!b) {
        munmap(base, size);
        *err = -ENOMEM;
        return NULL;
    }
    if (create) {
        int rc = end_claim(&h->end[0], NULL, pid, start, &b->my_gen);
        if (rc) {
            munmap(base, size);
            free(b);
            *err = rc;
            return NULL;
        }
    }
    b->h = h;
    b->map_size = size;
    b->owner = create;
    b->my_pid = pid;
    b->my_start = start;
    b->spin_ns = HPKV_DEFAULT_SPIN_NS;
    return b;
}

void hpkv_doorbell_unmap(hpkv_doorbell *b)
{
    if (!b)
        return;
    if (b->owner)
        end_release(&b->h->end[0], b->my_pid, b->my_start, b->my_gen);
    munmap(b->h, b->map_size);
    free(b);
}

void hpkv_doorbell_ring(hpkv_doorbell *b)
{
    /* relaxed store + seq_cst fence: pending is ordered before the sleeper check (Dekker). */
    atomic_store_explicit(&b->h->pending, 1, memory_order_relaxed);
    atomic_thread_fence(memory_order_seq_cst);
    b->wakes += wake_if_sleeping(&b->h->sleeping);
}

static inline int bell_ready(hpkv_doorbell *b, hpkv_ring *const *rings, size_t n)
{
    /* relaxed: pending carries no data; the rings' own tail acquire loads do. */
    if (atomic_load_explicit(&b->h->pending, memory_order_relaxed) &&
        atomic_exchange_explicit(&b->h->pending, 0, memory_order_relaxed))
        return 1;
    for (size_t i = 0; i < n; i++)
        if (rings[i] && rings[i]->role == HPKV_RING_CONSUMER && ring_ready(rings[i]))
            return 1;
    return 0;
}

int hpkv_doorbell_wait(hpkv_doorbell *b, hpkv_ring *const *rings, size_t n, double timeout_s)
{
    if (bell_ready(b, rings, n))
        return 1;
    int64_t deadline = deadline_of(&b->deadline, timeout_s);
    int64_t t = now_ns();
    int64_t spin_end = t + b->spin_ns;
    while (t < spin_end && t < deadline) {
        for (int k = 0; k < 16; k++) {
            if (bell_ready(b, rings, n))
                return 1;
            cpu_relax();
        }
        t = now_ns();
    }
    _Atomic uint32_t *word = &b->h->sleeping;
    for (;;) {
        /* relaxed store + seq_cst fence: announce before the re-check of every ring (Dekker). */
        atomic_store_explicit(word, 1, memory_order_relaxed);
        atomic_thread_fence(memory_order_seq_cst);
        if (bell_ready(b, rings, n)) {
            atomic_store_explicit(word, 0, memory_order_relaxed); /* relaxed: a hint to producers */
            return 1;
        }
        int64_t left = deadline == INT64_MAX ? -1 : deadline - now_ns();
        if (deadline != INT64_MAX && left <= 0) {
            atomic_store_explicit(word, 0, memory_order_relaxed); /* relaxed: a hint to producers */
            return 0;
        }
        /* One sleep for the whole wait: a doorbell has no single peer to re-check. */
        b->sleeps++;
        long rc = futex_wait(word, 1, left);
        atomic_store_explicit(word, 0, memory_order_relaxed); /* relaxed: re-announced next round */
        if (rc == -EINTR)
            return -EINTR;
    }
}

void hpkv_doorbell_set_spin(hpkv_doorbell *b, int64_t spin_ns)
{
    b->spin_ns = spin_ns < 0 ? 0 : spin_ns;
}

void hpkv_doorbell_owner_info(const hpkv_doorbell *b, int32_t *pid, uint64_t *start_time,
                              uint32_t *generation, uint32_t *state)
{
    end_read(&b->h->end[0], state, pid, start_time, generation);
}

void hpkv_doorbell_stats(const hpkv_doorbell *b, uint64_t *sleeps, uint64_t *wakes)
{
    *sleeps = b->sleeps;
    *wakes = b->wakes;
}
