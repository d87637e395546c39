/* hpkv batched block copy: device KV-cache blocks <-> DRAM pool slots.
 *
 * Contract
 *  - Device side: block b of layer l lives at layout->layer_base[l] + b*block_stride
 *    and is page_bytes long (block_stride >= page_bytes; padding is never touched).
 *  - Pool side: slot s lives at pool_base + s*slot_stride and holds every layer of one
 *    block back to back: layer l at offset l*page_bytes (slot_stride >= num_layers*page_bytes).
 *  - hpkv_copy_blocks copies pair i (dev_blocks[i], slots[i]) for i < n, in the direction
 *    given (HPKV_SAVE: device -> pool, HPKV_LOAD: pool -> device). It validates the
 *    whole batch before copying a byte, so an error means nothing was copied.
 *  - Return value: 0 on success, HPKV_COPY_EARG for bad arguments, otherwise
 *    kind - HPKV_COPY_ERR_STRIDE*i where i is the first bad pair in the batch and kind is
 *    HPKV_COPY_EBLOCK (dev_blocks[i] not in [0, num_blocks)) or HPKV_COPY_ESLOT
 *    (slots[i] not in [0, num_slots)); see hpkv_copy_error_* below to decode.
 *  - Large batches use non-temporal stores; the call ends with a store fence, so
 *    publishing completion with a release store afterwards is enough for other cores.
 *  - Ids are read once more as they are used and re-checked, so ids in shared memory
 *    that a peer rewrites during the call can never move memory out of bounds (such a
 *    race is a protocol violation and may leave the batch partly copied).
 *  - Reentrant; memory regions of different pairs must not overlap (duplicate slots in
 *    one SAVE batch or duplicate blocks in one LOAD batch: last pair wins).
 */
#ifndef HPKV_COPY_H
#define HPKV_COPY_H

#include <stdint.h>

typedef struct hpkv_layout {
    const uint64_t *layer_base; /* num_layers addresses of block 0 of each layer */
    uint64_t num_layers;
    uint64_t num_blocks;
    uint64_t block_stride; /* bytes between consecutive blocks of one layer */
    uint64_t page_bytes;   /* bytes of one block in one layer */
} hpkv_layout;

enum { HPKV_SAVE = 0, HPKV_LOAD = 1 };

enum {
    HPKV_COPY_OK = 0,
    HPKV_COPY_EARG = -1,   /* NULL pointer, bad direction, or slot_stride too small */
    HPKV_COPY_EBLOCK = -2, /* a device block id out of range */
    HPKV_COPY_ESLOT = -3   /* a pool slot id out of range */
};
#define HPKV_COPY_ERR_STRIDE 4

int64_t hpkv_copy_blocks(const hpkv_layout *layout, uint8_t *pool_base, uint64_t slot_stride,
                         uint64_t num_slots, const int64_t *dev_blocks, const int64_t *slots,
                         uint64_t n, int direction);

/* Batches of at least this many bytes use non-temporal stores (default 1 MiB:
 * beyond L2 the destination is evicted before anyone reads it, and streaming
 * stores skip the read-for-ownership). Returns the previous value. */
uint64_t hpkv_copy_set_nt_threshold(uint64_t bytes);

#endif
