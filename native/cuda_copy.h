/* hpkv CUDA block copies: device KV-cache blocks <-> pinned DRAM pool slots, by DMA.
 *
 * Contract
 *  - The CUDA driver (libcuda.so.1) is loaded with dlopen at the first call, never linked:
 *    the package builds and imports on machines without CUDA. hpkv_cuda_available() says why
 *    not ("" when the driver is usable). The few driver types used are declared here.
 *  - hpkv_cuda_plan turns a batch of (block, slot) pairs into copy descriptors (dst, src, size),
 *    exactly the bytes hpkv_copy_blocks (copy.h) moves for the same layout, with consecutive
 *    runs merged (a BLNHC block is one run, and consecutive blocks into consecutive slots are
 *    one). It validates the whole batch first: ids as hpkv_copy_blocks does (same return
 *    codes), and every layer's span against [dev_lo, dev_hi), the imported allocation (EARG).
 *    Returns the number of descriptors (>= 0) or an error; cap must be >= n * num_layers.
 *  - hpkv_cuda_copy_blocks plans into the caller's (reusable) arrays and issues one
 *    cuMemcpyBatchAsync on `stream` (driver >= 12.8), else a loop of cuMemcpyAsync. Saves keep
 *    stream order for their source (vLLM's compute stream still writes the KV cache); loads
 *    let the driver read the pool in any order. Returns like hpkv_cuda_plan (count on success);
 *    a driver error is stored in *cu_err (then nothing more of the batch is issued).
 *  - The other calls are thin wrappers of one driver call each; they return the CUresult
 *    (0 success, HPKV_CU_NOT_LOADED when the driver could not be loaded).
 *  - Handles (streams, events, contexts) travel as uint64 so that Python holds plain ints.
 */
#ifndef HPKV_CUDA_COPY_H
#define HPKV_CUDA_COPY_H

#include <stdint.h>

#include "copy.h"

enum {
    HPKV_CU_NOT_LOADED = 100000, /* no libcuda, or a symbol missing */
    HPKV_CU_NOT_READY = 600      /* CUDA_ERROR_NOT_READY: an event has not completed yet */
};

const char *hpkv_cuda_available(void);
int hpkv_cuda_driver_version(void);
int hpkv_cuda_has_batch(void);
const char *hpkv_cuda_error_name(int rc);

int64_t hpkv_cuda_plan(const hpkv_layout *layout, uint64_t dev_lo, uint64_t dev_hi,
                       uint64_t pool_base, uint64_t slot_stride, uint64_t num_slots,
                       const int64_t *dev_blocks, const int64_t *slots, uint64_t n, int direction,
                       uint64_t *dst, uint64_t *src, uint64_t *size, uint64_t cap);
/* Execute descriptors with memcpy: the host stand-in for the DMA engine (tests, host mode). */
void hpkv_desc_memcpy(const uint64_t *dst, const uint64_t *src, const uint64_t *size, uint64_t n);

int64_t hpkv_cuda_copy_blocks(const hpkv_layout *layout, uint64_t dev_lo, uint64_t dev_hi,
                              uint64_t pool_base, uint64_t slot_stride, uint64_t num_slots,
                              const int64_t *dev_blocks, const int64_t *slots, uint64_t n,
                              int direction, uint64_t stream, uint64_t *dst, uint64_t *src,
                              uint64_t *size, uint64_t cap, int *cu_err);

int hpkv_cuda_device_by_uuid(const uint8_t *uuid16, int *ordinal);
int hpkv_cuda_device_uuid(int ordinal, uint8_t *uuid16);
int hpkv_cuda_ctx_bind(int ordinal);
int hpkv_cuda_stream_create(int low_priority, uint64_t *stream);
int hpkv_cuda_stream_sync(uint64_t stream);
int hpkv_cuda_stream_wait_event(uint64_t stream, uint64_t event);
int hpkv_cuda_stream_destroy(uint64_t stream);
int hpkv_cuda_mem_export(uint64_t ptr, uint8_t *handle64, uint64_t *alloc_base,
                         uint64_t *alloc_bytes, int *ipc_capable);
int hpkv_cuda_mem_import(const uint8_t *handle64, uint64_t *dptr);
int hpkv_cuda_mem_close(uint64_t dptr);
int hpkv_cuda_event_create(int interprocess, uint64_t *event);
int hpkv_cuda_event_export(uint64_t event, uint8_t *handle64);
int hpkv_cuda_event_import(const uint8_t *handle64, uint64_t *event);
int hpkv_cuda_event_record(uint64_t event, uint64_t stream);
int hpkv_cuda_event_query(uint64_t event);
int hpkv_cuda_event_sync(uint64_t event);
int hpkv_cuda_event_destroy(uint64_t event);
int hpkv_cuda_host_register(uint64_t ptr, uint64_t bytes);
int hpkv_cuda_host_unregister(uint64_t ptr);
int hpkv_cuda_mem_get_info(uint64_t *free_bytes, uint64_t *total_bytes);

#endif
