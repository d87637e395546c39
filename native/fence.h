/* hpkv slot fence: one generation word per SLOT_UNIT (4 KiB) of the pool.
 *
 * Ties every save to the reservation it writes, so a copy submitted after its
 * reservation was released can never land in a slot that another key now owns.
 *
 * Invariants
 *  - The server owns the generations: it bumps a slot's word when it frees the slot
 *    (hpkv_fence_bump), and hands the current generation out with the slot (reserve).
 *  - A transfer worker, before it writes a batch of slots, takes each slot with a CAS
 *    that succeeds only if the word still holds the generation of the job and nobody
 *    holds it (hpkv_fence_enter); after the copy (ended with a store fence) it gives
 *    them back with a release store (hpkv_fence_leave).
 *  - The bump fails while a writer holds the slot: the server retries later, so the
 *    slot goes back to the allocator only when no copy into it can still land. A dead
 *    writer's holds are dropped by the server (hpkv_fence_clear_holder) before the
 *    writer's replacement starts (same holder id).
 *
 * Word: bits 0..22 generation (wraps), bits 24..31 holder (worker slot + 1; 0 = free).
 * 23 bits so that offset | generation << 40 stays a non-negative int64 (negative
 * values are the reserve answer's sentinels).
 */
#ifndef HPKV_FENCE_H
#define HPKV_FENCE_H

#include <stdint.h>

#define HPKV_FENCE_GEN_MASK 0x7FFFFFu
#define HPKV_FENCE_HOLDER_SHIFT 24

/* Take the slots at byte offsets offsets[i] (each < num_words * unit) for holder,
 * if every word still holds generation gens[i] and no other holder. All or nothing:
 * returns 0 when every slot is held, else -(i + 1) for the first refused pair (the
 * slots taken before it are given back), or HPKV_FENCE_EARG for bad arguments. */
int64_t hpkv_fence_enter(uint32_t *words, uint64_t num_words, uint64_t unit, const int64_t *offsets,
                         const uint32_t *gens, uint64_t n, uint32_t holder);
/* Give back what hpkv_fence_enter took (same arguments). */
void hpkv_fence_leave(uint32_t *words, uint64_t num_words, uint64_t unit, const int64_t *offsets,
                      const uint32_t *gens, uint64_t n, uint32_t holder);
/* Next generation of word idx: the new generation, or -1 while a writer holds it
 * (retry later), -2 if idx is out of range. */
int64_t hpkv_fence_bump(uint32_t *words, uint64_t num_words, uint64_t idx);
/* Drop every hold of a dead writer; returns how many words it held. */
uint64_t hpkv_fence_clear_holder(uint32_t *words, uint64_t num_words, uint32_t holder);

#define HPKV_FENCE_EARG (-(1LL << 62))

#endif
