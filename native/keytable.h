/* hpkv key table: 16-byte block key -> (owning namespace id, small value: the tier a
 * lookup reports, or the catalog's flags).
 *
 * The server's hot lookup asks "how many of these n keys, from the first, are
 * present, and in which tier" for up to thousands of keys per call; doing it in C
 * over the keys where the client wrote them (the mailbox) costs ~20-40 ns a key
 * instead of ~100 ns in Python. Single-threaded: only the server's index (under
 * its lock) touches a table. Open addressing, linear probing, tombstones,
 * power-of-two capacity, grown at 85 % load (live + tombstones). The arrays are
 * mapped anonymously and unmapped when the table grows or is freed, so the memory of
 * a table that shrank or moved goes back to the system at once.
 *
 * A key belongs to one namespace (the server's index decides which): a lookup made
 * for another namespace does not see it, so no namespace is ever told of, or handed,
 * a block sized for another.
 *
 * A table made with columns (hpkv_keytable_new_columns: the storage catalog's) also
 * keeps, per key, a 64-bit recency (larger = more recently used; the catalog's LRU) and
 * a 32-bit stamp (the catalog's last verification time), 12 bytes a slot, so that the
 * catalog needs no per-key object of its own: ~30 bytes a slot in all.
 */
#ifndef HPKV_KEYTABLE_H
#define HPKV_KEYTABLE_H

#include <stddef.h>
#include <stdint.h>

typedef struct hpkv_keytable hpkv_keytable;

/* Namespace ids are 0..63 (hpkv/protocol/stats.py MAX_NS), values 1..3 (the tiers). */
#define HPKV_KEYTABLE_MAX_NS 64

hpkv_keytable *hpkv_keytable_new(uint64_t initial_capacity);
/* A table with the recency and stamp columns. */
hpkv_keytable *hpkv_keytable_new_columns(uint64_t initial_capacity);
void hpkv_keytable_free(hpkv_keytable *t);
/* Insert or update the key's owner `ns` (0..63) and value (1..3); a key new to a table with
 * columns starts with recency and stamp 0. Returns 0, -1 when out of memory, -2 for an ns
 * or value out of range. */
int hpkv_keytable_set(hpkv_keytable *t, const uint8_t *key, uint8_t ns, uint8_t value);
/* The value, or 0 when absent; the owner goes to *ns unless ns is NULL. */
uint8_t hpkv_keytable_get(const hpkv_keytable *t, const uint8_t *key, uint8_t *ns);
/* 1 if removed, 0 if absent. */
int hpkv_keytable_remove(hpkv_keytable *t, const uint8_t *key);
uint64_t hpkv_keytable_len(const hpkv_keytable *t);
/* Slots (live, free and tombstones): what the arrays are sized for. */
uint64_t hpkv_keytable_capacity(const hpkv_keytable *t);
/* keys: n consecutive 16-byte keys. Writes the value of each leading key present and
 * owned by namespace `ns` into out[i] and returns how many leading keys are. */
uint64_t hpkv_keytable_prefix(const hpkv_keytable *t, uint8_t ns, const uint8_t *keys, uint64_t n,
                              uint8_t *out);
/* The value of each of n consecutive 16-byte keys present and owned by namespace `ns` into
 * out[i] (0 for the others); returns how many are. */
uint64_t hpkv_keytable_each(const hpkv_keytable *t, uint8_t ns, const uint8_t *keys, uint64_t n,
                            uint8_t *out);

/* The key's meta byte (owner << 2 | value; 0 when absent) in bits 0..7 and, in a table with
 * columns, its stamp in bits 8..39: one call where Python needs both. */
uint64_t hpkv_keytable_peek(const hpkv_keytable *t, const uint8_t *key);
/* The value of each of n consecutive 16-byte keys (0: absent) to out[i]. */
void hpkv_keytable_get_many(const hpkv_keytable *t, const uint8_t *keys, uint64_t n, uint8_t *out);
/* Insert or update n consecutive 16-byte keys, all owned by `ns` with `value`; in a table with
 * columns key i also gets recency rec + i * rec_step (and stamp 0 when new). Returns as
 * hpkv_keytable_set (the keys before a failure are in). */
int hpkv_keytable_set_many(hpkv_keytable *t, const uint8_t *keys, uint64_t n, uint8_t ns,
                           uint8_t value, uint64_t rec, int64_t rec_step);

/* ---- tables with columns (others: these return 0 and change nothing) ---- */
/* The value (0: absent) and, for a present key, its owner, recency and stamp (any out
 * pointer may be NULL). */
uint8_t hpkv_keytable_get_columns(const hpkv_keytable *t, const uint8_t *key, uint8_t *ns,
                                  uint64_t *rec, uint32_t *stamp);
/* Set a present key's recency / stamp: 1, or 0 when absent. */
int hpkv_keytable_set_recency(hpkv_keytable *t, const uint8_t *key, uint64_t rec);
int hpkv_keytable_set_stamp(hpkv_keytable *t, const uint8_t *key, uint32_t stamp);
/* The (at most) k keys whose value has a bit of `mask`, of smallest recency, least recent
 * first: keys to keys_out (16 bytes each), their recencies to rec_out. Returns how many.
 * One pass over the table keeping a heap of k: O(capacity + n log k). */
uint64_t hpkv_keytable_oldest(const hpkv_keytable *t, uint8_t mask, uint64_t k, uint8_t *keys_out,
                              uint64_t *rec_out);
/* For each of n consecutive 16-byte keys, out[i] = 1 when it is present with a bit of `mask`,
 * owned by `ns`, and its stamp is 0 or at least `age` older than `now` (modulo 2^32), else 0.
 * Returns how many are. */
uint64_t hpkv_keytable_stale(const hpkv_keytable *t, const uint8_t *keys, uint64_t n, uint8_t ns,
                             uint8_t mask, uint32_t now, uint32_t age, uint8_t *out);
/* Up to `max` keys owned by `ns` (any owner when ns < 0) whose value has a bit of `mask`,
 * in slot order, to keys_out. Returns how many. */
uint64_t hpkv_keytable_select(const hpkv_keytable *t, int ns, uint8_t mask, uint8_t *keys_out,
                              uint64_t max);

#endif
