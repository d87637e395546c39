/* Read-only peek at a ring file's fill level, for monitors (hpkv-top, metrics).
 *
 * Attaching a ring claims one of its two ends, which would take the end away from
 * the process that owns it; a monitor must not do that. hpkv_ring_peek maps the
 * file read-only, reads capacity, head and tail, and unmaps: it writes nothing.
 */
#ifndef HPKV_RINGPEEK_H
#define HPKV_RINGPEEK_H

#include <stdint.h>

#include "ring.h"

/* Fill level of the ring file at `path`: 0 and *depth = tail - head (clamped to
 * [0, capacity]: the two counters are read one after the other while both sides
 * run), *capacity = its slot count. -errno when the file cannot be opened or
 * mapped (-ENOENT: the ring is gone); HPKV_RING_EBADFILE when it is not a ring
 * file; HPKV_RING_EVERSION when it is a ring of another HPKV_RING_VERSION. */
int hpkv_ring_peek(const char *path, uint64_t *depth, uint32_t *capacity);

/* Lifetime counters of the ring file at `path`: descriptors ever pushed (the
 * producer's tail) and ever popped (the consumer's head); head is read first.
 * Same return codes as hpkv_ring_peek. The server uses them to know when every
 * job queued on a transfer worker before some moment has been executed. */
int hpkv_ring_peek_counts(const char *path, uint64_t *pushed, uint64_t *popped);

#endif
