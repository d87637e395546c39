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

/* A table grows when live slots and tombstones would pass this share of its slots (in %).
 * 85 % rather than the usual 70 %: the catalog's and the index's tables are most of the
 * server's memory per stored block (10^5 blocks: 2^17 slots instead of 2^18). Keys are
 * uniform hashes, so probes stay short: 128 keys absent from a table of 10^5 at 76 % load
 * took 3.5 us (p50) against 1.5 us at 38 %, present ones 2.5 against 1.6-2.9 us; a
 * lookup's round trip to the server is 30 us and more. */
#define MAX_LOAD_PCT 85

/* Old slots moved into the new arrays per insert or removal while the table grows. A doubled
 * table (cap slots, the old arrays cap/2) is at 42.5 % and full again (85 %) after 0.425 cap
 * inserts; the move ends after cap/32 calls. One call never moves more than this many, so none
 * holds its caller's lock for a whole rehash (~100 ms at a million keys). */
#define MOVE_STEP 16

typedef struct {
    key128 *keys;
    uint8_t *state;
    uint8_t *meta;
    uint64_t *rec;   /* recency per slot; NULL in a table without columns */
    uint32_t *stamp; /* stamp per slot; NULL likewise */
    uint64_t cap;    /* power of two; 0: no arrays */
    uint64_t live;
    uint64_t tombs;
} slots;

/* A key lives in `cur` or, while the table grows, in `old`, never in both. Growing maps new
 * arrays as `cur` and moves `old`'s keys over MOVE_STEP slots at a time (`moved` is the
 * next old slot to move); a moved slot becomes a tombstone, so probes for keys not yet
 * moved still find them. Lookups look in `cur`, then in `old`. */
struct hpkv_keytable {
    slots cur;
    slots old;
    uint64_t moved;
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

static void free_slots(slots *s)
{
    unmap(s->keys, s->cap * sizeof(key128));
    unmap(s->state, s->cap);
    unmap(s->meta, s->cap);
    unmap(s->rec, s->cap * sizeof(uint64_t));
    unmap(s->stamp, s->cap * sizeof(uint32_t));
    memset(s, 0, sizeof(*s));
}

static int alloc_slots(slots *s, uint64_t cap, int columns)
{
    memset(s, 0, sizeof(*s));
    s->cap = cap;
    s->keys = map(cap * sizeof(key128));
    s->state = map(cap);
    s->meta = map(cap);
    s->rec = columns ? map(cap * sizeof(uint64_t)) : NULL;
    s->stamp = columns ? map(cap * sizeof(uint32_t)) : NULL;
    if (!s->keys || !s->state || !s->meta || (columns && (!s->rec || !s->stamp))) {
        free_slots(s);
        return -1;
    }
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
    if (alloc_slots(&t->cur, cap, columns) != 0) {
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
    free_slots(&t->cur);
    free_slots(&t->old);
    free(t);
}

/* Index of the key's slot in `s`, or of the slot where it would go (first tombstone or empty). */
static uint64_t find(const slots *s, key128 k, int *found)
{
    uint64_t i = slot_of(k, s->cap), first_tomb = UINT64_MAX;
    for (;;) {
        uint8_t st = s->state[i];
        if (st == EMPTY) {
            *found = 0;
            return first_tomb != UINT64_MAX ? first_tomb : i;
        }
        if (st == FULL && s->keys[i].lo == k.lo && s->keys[i].hi == k.hi) {
            *found = 1;
            return i;
        }
        if (st == TOMB && first_tomb == UINT64_MAX)
            first_tomb = i;
        i = (i + 1) & (s->cap - 1);
    }
}

/* The arrays holding the key and its slot there, or NULL. */
static slots *locate(const hpkv_keytable *t, key128 k, uint64_t *slot)
{
    int found;
    uint64_t i = find(&t->cur, k, &found);
    if (found) {
        *slot = i;
        return (slots *)&t->cur;
    }
    if (t->old.cap) {
        i = find(&t->old, k, &found);
        if (found) {
            *slot = i;
            return (slots *)&t->old;
        }
    }
    return NULL;
}

/* Put a key that is in neither array into `cur` (which has room), with its columns. */
static uint64_t place(hpkv_keytable *t, key128 k, uint8_t meta, uint64_t rec, uint32_t stamp)
{
    slots *s = &t->cur;
    int found;
    uint64_t i = find(s, k, &found);
    if (s->state[i] == TOMB)
        s->tombs--;
    s->keys[i] = k;
    s->state[i] = FULL;
    s->meta[i] = meta;
    if (t->columns) {
        s->rec[i] = rec;
        s->stamp[i] = stamp;
    }
    s->live++;
    return i;
}

/* Move the next `n` old slots into `cur`; the old arrays go when all are moved. */
static void move_some(hpkv_keytable *t, uint64_t n)
{
    slots *o = &t->old;
    if (!o->cap)
        return;
    for (; n > 0 && t->moved < o->cap; n--, t->moved++) {
        uint64_t i = t->moved;
        if (o->state[i] != FULL)
            continue;
        place(t, o->keys[i], o->meta[i], t->columns ? o->rec[i] : 0, t->columns ? o->stamp[i] : 0);
        o->state[i] = TOMB;
        o->live--;
        o->tombs++;
    }
    if (t->moved == o->cap)
        free_slots(o);
}

/* Start growing: new arrays as `cur`, the present ones as `old`, moved over later calls. */
static int grow(hpkv_keytable *t)
{
    move_some(t, UINT64_MAX); /* a grow still moving (only if MOVE_STEP were too small) ends now */
    uint64_t live = t->cur.live;
    /* Double only when live entries need it; otherwise rebuild to drop tombstones. */
    uint64_t cap = (live + 1) * 100 / MAX_LOAD_PCT >= t->cur.cap / 2 ? t->cur.cap * 2 : t->cur.cap;
    slots fresh;
    if (alloc_slots(&fresh, cap, t->columns) != 0)
        return -1;
    t->old = t->cur;
    t->cur = fresh;
    t->moved = 0;
    return 0;
}

int hpkv_keytable_set(hpkv_keytable *t, const uint8_t *key, uint8_t ns, uint8_t value)
{
    if (value == 0 || value > VALUE_MASK || ns > HPKV_KEYTABLE_MAX_NS - 1)
        return -2;
    uint8_t meta = (uint8_t)(ns << VALUE_BITS | value);
    key128 k = load_key(key);
    uint64_t i;
    slots *s = locate(t, k, &i);
    if (s == &t->cur) {
        s->meta[i] = meta;
        return 0;
    }
    if ((t->cur.live + t->cur.tombs + 1) * 100 > t->cur.cap * MAX_LOAD_PCT) {
        if (grow(t) != 0)
            return -1;
        s = locate(t, k, &i); /* the key may have moved */
        if (s == &t->cur) {
            s->meta[i] = meta;
            return 0;
        }
    }
    uint64_t rec = 0;
    uint32_t stamp = 0;
    if (s) { /* in the old arrays: it moves now, with its columns */
        if (t->columns) {
            rec = s->rec[i];
            stamp = s->stamp[i];
        }
        s->state[i] = TOMB;
        s->live--;
        s->tombs++;
    }
    place(t, k, meta, rec, stamp);
    move_some(t, MOVE_STEP);
    return 0;
}

uint8_t hpkv_keytable_get(const hpkv_keytable *t, const uint8_t *key, uint8_t *ns)
{
    uint64_t i;
    const slots *s = locate(t, load_key(key), &i);
    if (!s)
        return 0;
    if (ns)
        *ns = s->meta[i] >> VALUE_BITS;
    return s->meta[i] & VALUE_MASK;
}

int hpkv_keytable_remove(hpkv_keytable *t, const uint8_t *key)
{
    uint64_t i;
    slots *s = locate(t, load_key(key), &i);
    if (!s)
        return 0;
    s->state[i] = TOMB;
    s->live--;
    s->tombs++;
    move_some(t, MOVE_STEP);
    return 1;
}

uint64_t hpkv_keytable_len(const hpkv_keytable *t)
{
    return t->cur.live + t->old.live;
}

uint64_t hpkv_keytable_capacity(const hpkv_keytable *t)
{
    return t->cur.cap + t->old.cap;
}

uint64_t hpkv_keytable_prefix(const hpkv_keytable *t, uint8_t ns, const uint8_t *keys, uint64_t n,
                              uint8_t *out)
{
    for (uint64_t j = 0; j < n; j++) {
        uint64_t i;
        const slots *s = locate(t, load_key(keys + 16 * j), &i);
        if (!s || s->meta[i] >> VALUE_BITS != ns) /* another namespace's key is absent to it */
            return j;
        out[j] = s->meta[i] & VALUE_MASK;
    }
    return n;
}

uint64_t hpkv_keytable_each(const hpkv_keytable *t, uint8_t ns, const uint8_t *keys, uint64_t n,
                            uint8_t *out)
{
    uint64_t found = 0;
    for (uint64_t j = 0; j < n; j++) {
        uint64_t i;
        const slots *s = locate(t, load_key(keys + 16 * j), &i);
        out[j] = (s && s->meta[i] >> VALUE_BITS == ns) ? s->meta[i] & VALUE_MASK : 0;
        found += out[j] != 0;
    }
    return found;
}

uint64_t hpkv_keytable_peek(const hpkv_keytable *t, const uint8_t *key)
{
    uint64_t i;
    const slots *s = locate(t, load_key(key), &i);
    if (!s)
        return 0;
    return s->meta[i] | (t->columns ? (uint64_t)s->stamp[i] << 8 : 0);
}

void hpkv_keytable_get_many(const hpkv_keytable *t, const uint8_t *keys, uint64_t n, uint8_t *out)
{
    for (uint64_t j = 0; j < n; j++) {
        uint64_t i;
        const slots *s = locate(t, load_key(keys + 16 * j), &i);
        out[j] = s ? s->meta[i] & VALUE_MASK : 0;
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
            hpkv_keytable_set_recency(t, keys + 16 * j, rec + (uint64_t)((int64_t)j * rec_step));
    }
    return 0;
}

/* ------------------------------------------------------------------ columns */
uint8_t hpkv_keytable_get_columns(const hpkv_keytable *t, const uint8_t *key, uint8_t *ns,
                                  uint64_t *rec, uint32_t *stamp)
{
    uint64_t i;
    const slots *s = t->columns ? locate(t, load_key(key), &i) : NULL;
    if (!s)
        return 0;
    if (ns)
        *ns = s->meta[i] >> VALUE_BITS;
    if (rec)
        *rec = s->rec[i];
    if (stamp)
        *stamp = s->stamp[i];
    return s->meta[i] & VALUE_MASK;
}

int hpkv_keytable_set_recency(hpkv_keytable *t, const uint8_t *key, uint64_t rec)
{
    uint64_t i;
    slots *s = t->columns ? locate(t, load_key(key), &i) : NULL;
    if (!s)
        return 0;
    s->rec[i] = rec;
    return 1;
}

int hpkv_keytable_set_stamp(hpkv_keytable *t, const uint8_t *key, uint32_t stamp)
{
    uint64_t i;
    slots *s = t->columns ? locate(t, load_key(key), &i) : NULL;
    if (!s)
        return 0;
    s->stamp[i] = stamp;
    return 1;
}

/* A max-heap of (recency, key) by recency: its top is the newest of the k oldest so far. */
typedef struct {
    uint64_t rec;
    key128 key;
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

static uint64_t heap_scan(const slots *s, uint8_t mask, aged *heap, uint64_t n, uint64_t k)
{
    for (uint64_t i = 0; i < s->cap; i++) {
        if (s->state[i] != FULL || !(s->meta[i] & mask))
            continue;
        if (n < k) {
            heap[n] = (aged){s->rec[i], s->keys[i]};
            sift_up(heap, n++);
        } else if (s->rec[i] < heap[0].rec) {
            heap[0] = (aged){s->rec[i], s->keys[i]};
            sift_down(heap, n, 0);
        }
    }
    return n;
}

uint64_t hpkv_keytable_oldest(const hpkv_keytable *t, uint8_t mask, uint64_t k, uint8_t *keys_out,
                              uint64_t *rec_out)
{
    uint64_t live = hpkv_keytable_len(t);
    if (!t->columns || k == 0 || live == 0)
        return 0;
    if (k > live)
        k = live;
    aged *heap = malloc(k * sizeof(aged));
    if (!heap)
        return 0;
    uint64_t n = heap_scan(&t->cur, mask, heap, 0, k);
    if (t->old.cap)
        n = heap_scan(&t->old, mask, heap, n, k);
    /* Heap sort in place: the largest goes last, so the array ends up least recent first. */
    for (uint64_t m = n; m > 1; m--) {
        aged tmp = heap[0];
        heap[0] = heap[m - 1];
        heap[m - 1] = tmp;
        sift_down(heap, m - 1, 0);
    }
    for (uint64_t j = 0; j < n; j++) {
        memcpy(keys_out + 16 * j, &heap[j].key, 16);
        rec_out[j] = heap[j].rec;
    }
    free(heap);
    return n;
}

uint64_t hpkv_keytable_stale(const hpkv_keytable *t, const uint8_t *keys, uint64_t n, uint8_t ns,
                             uint8_t mask, uint32_t now, uint32_t age, uint8_t *out)
{
    uint64_t stale = 0;
    for (uint64_t j = 0; j < n; j++) {
        uint64_t i;
        const slots *s = t->columns ? locate(t, load_key(keys + 16 * j), &i) : NULL;
        out[j] = s && (s->meta[i] & mask) && s->meta[i] >> VALUE_BITS == ns &&
                 (s->stamp[i] == 0 || (uint32_t)(now - s->stamp[i]) >= age);
        stale += out[j];
    }
    return stale;
}

static uint64_t select_in(const slots *s, int ns, uint8_t mask, uint8_t *keys_out, uint64_t n,
                          uint64_t max)
{
    for (uint64_t i = 0; i < s->cap && n < max; i++) {
        if (s->state[i] != FULL || !(s->meta[i] & mask))
            continue;
        if (ns >= 0 && s->meta[i] >> VALUE_BITS != (unsigned)ns)
            continue;
        memcpy(keys_out + 16 * n++, &s->keys[i], 16);
    }
    return n;
}

uint64_t hpkv_keytable_select(const hpkv_keytable *t, int ns, uint8_t mask, uint8_t *keys_out,
                              uint64_t max)
{
    uint64_t n = select_in(&t->cur, ns, mask, keys_out, 0, max);
    if (t->old.cap)
        n = select_in(&t->old, ns, mask, keys_out, n, max);
    return n;
}
