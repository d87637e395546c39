/* hpkv key table: 16-byte block key -> (owning namespace id, small value: the tier a
 * lookup reports).
 *
 * The server's hot lookup asks "how many of these n keys, from the first, are
 * present, and in which tier" for up to thousands of keys per call; doing it in C
 * over the keys where the client wrote them (the mailbox) costs ~20-40 ns a key
 * instead of ~100 ns in Python. Single-threaded: only the server's index (under
 * its lock) touches a table. Open addressing, linear probing, tombstones,
 * power-of-two capacity, grown at 70 % load (live + tombstones).
 *
 * A key belongs to one namespace (the server's index decides which): a lookup made
 * for another namespace does not see it, so no namespace is ever told of, or handed,
 * a block sized for another.
 */
#ifndef HPKV_KEYTABLE_H
#define HPKV_KEYTABLE_H

#include <stddef.h>
#include <stdint.h>

typedef struct hpkv_keytable hpkv_keytable;

/* Namespace ids are 0..63 (hpkv/protocol/stats.py MAX_NS), values 1..3 (the tiers). */
#define HPKV_KEYTABLE_MAX_NS 64

hpkv_keytable *hpkv_keytable_new(uint64_t initial_capacity);
void hpkv_keytable_free(hpkv_keytable *t);
/* Insert or update the key's owner `ns` (0..63) and value (1..3). Returns 0, -1 when out
 * of memory, -2 for an ns or value out of range. */
int hpkv_keytable_set(hpkv_keytable *t, const uint8_t *key, uint8_t ns, uint8_t value);
/* The value, or 0 when absent; the owner goes to *ns unless ns is NULL. */
uint8_t hpkv_keytable_get(const hpkv_keytable *t, const uint8_t *key, uint8_t *ns);
/* 1 if removed, 0 if absent. */
int hpkv_keytable_remove(hpkv_keytable *t, const uint8_t *key);
uint64_t hpkv_keytable_len(const hpkv_keytable *t);
/* keys: n consecutive 16-byte keys. Writes the value of each leading key present and
 * owned by namespace `ns` into out[i] and returns how many leading keys are. */
uint64_t hpkv_keytable_prefix(const hpkv_keytable *t, uint8_t ns, const uint8_t *keys, uint64_t n,
                              uint8_t *out);

#endif
