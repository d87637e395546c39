#include "keytable.h"

#include <stdlib.h>
#include <string.h>

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
    uint64_t cap; /* power of two */
    uint64_t live;
    uint64_t tombs;
};

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

static int alloc_arrays(hpkv_keytable *t, uint64_t cap)
{
    t->keys = malloc(cap * sizeof(key128));
    t->state = calloc(cap, 1);
    t->meta = malloc(cap);
    if (!t->keys || !t->state || !t->meta) {
        free(t->keys);
        free(t->state);
        free(t->meta);
        return -1;
    }
    t->cap = cap;
    t->live = t->tombs = 0;
    return 0;
}

hpkv_keytable *hpkv_keytable_new(uint64_t initial_capacity)
{
    uint64_t cap = 1024;
    while (cap < initial_capacity)
        cap <<= 1;
    hpkv_keytable *t = calloc(1, sizeof(*t));
    if (!t)
        return NULL;
    if (alloc_arrays(t, cap) != 0) {
        free(t);
        return NULL;
    }
    return t;
}

void hpkv_keytable_free(hpkv_keytable *t)
{
    if (!t)
        return;
    free(t->keys);
    free(t->state);
    free(t->meta);
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
        t->live++;
    }
    free(old.keys);
    free(old.state);
    free(old.meta);
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
    }
    t->meta[i] = (uint8_t)(ns << VALUE_BITS | value);
    return 0;
}

uint8_t hpkv_keytable_get(const hpkv_keytable *t, const uint8_t *key, uint8_t *ns)
{
    int found;
    uint64_t i = find(t, load_key(key), &found);
    if (!found)
        return 0;
    if (ns)
        *ns = t->meta[i] >> VALUE_BITS;
    return t->meta[i] & VALUE_MASK;
}

int hpkv_keytable_remove(hpkv_keytable *t, const uint8_t *key)
{
    int found;
    uint64_t i = find(t, load_key(key), &found);
    if (!found)
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
