#include "keytable.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

/* Slot states live in `state`: EMPTY ends a probe, TOMB keeps it going. */
enum { EMPTY = 0, FULL = 1, TOMB = 2 };

typedef struct {
    uint64_t lo, hi; /* the key; keys are already uniform hashes (blake2b) */
} key128;

/* What a lookup needs of a full slot besides the key, in one byte: the value (the tier)
 * in the low bits, the namespace that owns the key above them. One byte a slot keeps the
 * array as small as it was before namespaces were stored. */
#define VALUE_BITS 2
#define VALUE_MASK ((1u << VALUE_BITS) - 1)

struct hpkv_keytable {
    key128 *keys;
    uint8_t *state;
    uint8_t *meta;
    uint64_t *rec;   /* recency per slot; NULL in a table without columns */
    uint32_t *stamp; /* stamp per slot; NULL likewise */
    uint64_t cap;    /* power of two */
    uint64_t live;
    uint64_t tombs;
    int columns;
};

/* Anonymous mappings: zero-filled, and given back whole by munmap (malloc keeps freed
 * blocks of up to 32 MiB in its heap once its mmap threshold has grown). */
static void *map(size_t bytes)
{
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static void unmap(void *p, size_t bytes)
{
    if (p)
        munmap(p, bytes);
}

static inline key128 load_key(const uint8_t *p)
{
    key128 k;
    memcpy(&k.lo, p, 8);
    memcpy(&k.hi, p + 8, 8);
    return k;
}

static inline uint64_t slot_of(key128 k, uint64_t cap)
{
    /* The key is a cryptographic hash: its low bits are already uniform. */
    return (k.lo ^ (k.hi >> 7)) & (cap - 1);
}

static void free_arrays(hpkv_keytable *t)
{
    unmap(t->keys, t->cap * sizeof(key128));
    unmap(t->state, t->cap);
    unmap(t->meta, t->cap);
    unmap(t->rec, t->cap * sizeof(uint64_t));
    unmap(t->stamp, t->cap * sizeof(uint32_t));
    t->keys = NULL;
    t->state = t->meta = NULL;
    t->rec = NULL;
    t->stamp = NULL;
}

static int alloc_arrays(hpkv_keytable *t, uint64_t cap)
{
    t->cap = cap;
    t->keys = map(cap * sizeof(key128));
    t->state = map(cap);
    t->meta = map(cap);
    t->rec = t->columns ? map(cap * sizeof(uint64_t)) : NULL;
    t->stamp = t->columns ? map(cap * sizeof(uint32_t)) : NULL;
    if (!t->keys || !t->state || !t->meta || (t->columns && (!t->rec || !t->stamp))) {
        free_arrays(t);
        return -1;
    }
    t->live = t->tombs = 0;
    return 0;
}

static hpkv_keytable *make(uint64_t initial_capacity, int columns)
{
    uint64_t cap = 1024;
    while (cap < initial_capacity)
        cap <<= 1;
    hpkv_keytable *t = calloc(1, sizeof(*t));
    if (!t)
        return NULL;
    t->columns = columns;
    if (alloc_arrays(t, cap) != 0) {
        free(t);
        return NULL;
    }
    return t;
}

hpkv_keytable *hpkv_keytable_new(uint64_t initial_capacity)
{
    return make(initial_capacity, 0);
}

hpkv_keytable *hpkv_keytable_new_columns(uint64_t initial_capacity)
{
    return make(initial_capacity, 1);
}

void hpkv_keytable_free(hpkv_keytable *t)
{
    if (!t)
        return;
    free_arrays(t);
    free(t);
}

/* Index of the key's slot, or of the slot where it would go (first tombstone or empty). */
static uint64_t find(const hpkv_keytable *t, key128 k, int *found)
{
    uint64_t i = slot_of(k, t->cap), first_tomb = UINT64_MAX;
    for (;;) {
        uint8_t s = t->state[i];
        if (s == EMPTY) {
            *found = 0;
            return first_tomb != UINT64_MAX ? first_tomb : i;
        }
        if (s == FULL && t->keys[i].lo == k.lo && t->keys[i].hi == k.hi) {
            *found = 1;
            return i;
        }
        if (s == TOMB && first_tomb == UINT64_MAX)
            first_tomb = i;
        i = (i + 1) & (t->cap - 1);
    }
}

/* The slot of a present key, or -1. */
static int64_t slot_of_key(const hpkv_keytable *t, const uint8_t *key)
{
    int found;
    uint64_t i = find(t, load_key(key), &found);
    return found ? (int64_t)i : -1;
}

static int grow(hpkv_keytable *t)
{
    hpkv_keytable old = *t;
    /* Double only when live entries need it; otherwise rebuild to drop tombstones. */
    uint64_t cap = (t->live + 1) * 10 / 7 >= old.cap / 2 ? old.cap * 2 : old.cap;
    if (alloc_arrays(t, cap) != 0) {
        *t = old;
        return -1;
    }
    for (uint64_t i = 0; i < old.cap; i++) {
        if (old.state[i] != FULL)
            continue;
        int found;
        uint64_t j = find(t, old.keys[i], &found);
        t->keys[j] = old.keys[i];
        t->meta[j] = old.meta[i];
        t->state[j] = FULL;
        if (t->columns) {
            t->rec[j] = old.rec[i];
            t->stamp[j] = old.stamp[i];
        }
        t->live++;
    }
    free_arrays(&old);
    return 0;
}

int hpkv_keytable_set(hpkv_keytable *t, const uint8_t *key, uint8_t ns, uint8_t value)
{
    if (value == 0 || value > VALUE_MASK || ns > HPKV_KEYTABLE_MAX_NS - 1)
        return -2;
    if ((t->live + t->tombs + 1) * 10 > t->cap * 7 && grow(t) != 0)
        return -1;
    key128 k = load_key(key);
    int found;
    uint64_t i = find(t, k, &found);
    if (!found) {
        if (t->state[i] == TOMB)
            t->tombs--;
        t->keys[i] = k;
        t->state[i] = FULL;
        t->live++;
        if (t->columns) {
            t->rec[i] = 0;
            t->stamp[i] = 0;
        }
    }
    t->meta[i] = (uint8_t)(ns << VALUE_BITS | value);
    return 0;
}

uint8_t hpkv_keytable_get(const hpkv_keytable *t, const uint8_t *key, uint8_t *ns)
{
    int64_t i = slot_of_key(t, key);
    if (i < 0)
        return 0;
    if (ns)
        *ns = t->meta[i] >> VALUE_BITS;
    return t->meta[i] & VALUE_MASK;
}

int hpkv_keytable_remove(hpkv_keytable *t, const uint8_t *key)
{
    int64_t i = slot_of_key(t, key);
    if (i < 0)
        return 0;
    t->state[i] = TOMB;
    t->live--;
    t->tombs++;
    return 1;
}

uint64_t hpkv_keytable_len(const hpkv_keytable *t)
{
    return t->live;
}

uint64_t hpkv_keytable_capacity(const hpkv_keytable *t)
{
    return t->cap;
}

uint64_t hpkv_keytable_prefix(const hpkv_keytable *t, uint8_t ns, const uint8_t *keys, uint64_t n,
                              uint8_t *out)
{
    for (uint64_t j = 0; j < n; j++) {
        int found;
        uint64_t i = find(t, load_key(keys + 16 * j), &found);
        if (!found || t->meta[i] >> VALUE_BITS != ns) /* another namespace's key is absent to it */
            return j;
        out[j] = t->meta[i] & VALUE_MASK;
    }
    return n;
}

uint64_t hpkv_keytable_peek(const hpkv_keytable *t, const uint8_t *key)
{
    int64_t i = slot_of_key(t, key);
    if (i < 0)
        return 0;
    return t->meta[i] | (t->columns ? (uint64_t)t->stamp[i] << 8 : 0);
}

void hpkv_keytable_get_many(const hpkv_keytable *t, const uint8_t *keys, uint64_t n, uint8_t *out)
{
    for (uint64_t j = 0; j < n; j++) {
        int64_t i = slot_of_key(t, keys + 16 * j);
        out[j] = i < 0 ? 0 : t->meta[i] & VALUE_MASK;
    }
}

int hpkv_keytable_set_many(hpkv_keytable *t, const uint8_t *keys, uint64_t n, uint8_t ns,
                           uint8_t value, uint64_t rec, int64_t rec_step)
{
    for (uint64_t j = 0; j < n; j++) {
        int rc = hpkv_keytable_set(t, keys + 16 * j, ns, value);
        if (rc != 0)
            return rc;
        if (t->columns)
            t->rec[slot_of_key(t, keys + 16 * j)] = rec + (uint64_t)((int64_t)j * rec_step);
    }
    return 0;
}

/* ------------------------------------------------------------------ columns */
uint8_t hpkv_keytable_get_columns(const hpkv_keytable *t, const uint8_t *key, uint8_t *ns,
                                  uint64_t *rec, uint32_t *stamp)
{
    if (!t->columns)
        return 0;
    int64_t i = slot_of_key(t, key);
    if (i < 0)
        return 0;
    if (ns)
        *ns = t->meta[i] >> VALUE_BITS;
    if (rec)
        *rec = t->rec[i];
    if (stamp)
        *stamp = t->stamp[i];
    return t->meta[i] & VALUE_MASK;
}

int hpkv_keytable_set_recency(hpkv_keytable *t, const uint8_t *key, uint64_t rec)
{
    int64_t i = t->columns ? slot_of_key(t, key) : -1;
    if (i < 0)
        return 0;
    t->rec[i] = rec;
    return 1;
}

int hpkv_keytable_set_stamp(hpkv_keytable *t, const uint8_t *key, uint32_t stamp)
{
    int64_t i = t->columns ? slot_of_key(t, key) : -1;
    if (i < 0)
        return 0;
    t->stamp[i] = stamp;
    return 1;
}

/* A max-heap of (recency, slot) by recency: its top is the newest of the k oldest so far. */
typedef struct {
    uint64_t rec;
    uint64_t slot;
} aged;

static void sift_down(aged *h, uint64_t n, uint64_t i)
{
    for (;;) {
        uint64_t l = 2 * i + 1, r = l + 1, top = i;
        if (l < n && h[l].rec > h[top].rec)
            top = l;
        if (r < n && h[r].rec > h[top].rec)
            top = r;
        if (top == i)
            return;
        aged tmp = h[i];
        h[i] = h[top];
        h[top] = tmp;
        i = top;
    }
}

static void sift_up(aged *h, uint64_t i)
{
    while (i > 0) {
        uint64_t parent = (i - 1) / 2;
        if (h[parent].rec >= h[i].rec)
            return;
        aged tmp = h[i];
        h[i] = h[parent];
        h[parent] = tmp;
        i = parent;
    }
}

uint64_t hpkv_keytable_oldest(const hpkv_keytable *t, uint8_t mask, uint64_t k, uint8_t *keys_out,
                              uint64_t *rec_out)
{
    if (!t->columns || k == 0)
        return 0;
    if (k > t->live)
        k = t->live;
    aged *heap = malloc((k ? k : 1) * sizeof(aged));
    if (!heap)
        return 0;
    uint64_t n = 0;
    for (uint64_t i = 0; i < t->cap; i++) {
        if (t->state[i] != FULL || !(t->meta[i] & mask))
            continue;
        if (n < k) {
            heap[n] = (aged){t->rec[i], i};
            sift_up(heap, n++);
        } else if (t->rec[i] < heap[0].rec) {
            heap[0] = (aged){t->rec[i], i};
            sift_down(heap, n, 0);
        }
    }
    /* Heap sort in place: the largest goes last, so the array ends up least recent first. */
    for (uint64_t m = n; m > 1; m--) {
        aged tmp = heap[0];
        heap[0] = heap[m - 1];
        heap[m - 1] = tmp;
        sift_down(heap, m - 1, 0);
    }
    for (uint64_t j = 0; j < n; j++) {
        memcpy(keys_out + 16 * j, &t->keys[heap[j].slot], 16);
        rec_out[j] = heap[j].rec;
    }
    free(heap);
    return n;
}

uint64_t hpkv_keytable_select(const hpkv_keytable *t, int ns, uint8_t mask, uint8_t *keys_out,
                              uint64_t max)
{
    uint64_t n = 0;
    for (uint64_t i = 0; i < t->cap && n < max; i++) {
        if (t->state[i] != FULL || !(t->meta[i] & mask))
            continue;
        if (ns >= 0 && t->meta[i] >> VALUE_BITS != (unsigned)ns)
            continue;
        memcpy(keys_out + 16 * n++, &t->keys[i], 16);
    }
    return n;
}
