/* hpkv CUDA block copies (contract in cuda_copy.h).
 *
 * Why it looks like this:
 *  - dlopen + cuGetProcAddress instead of linking libcuda: CI and CPU-only installs build it.
 *  - cuMemcpyBatchAsync is resolved at version 12080, its 9-argument form (CUDA 13 remaps the
 *    plain name to an 8-argument _v2), as vLLM's swap_blocks_batch does.
 *  - One descriptor per contiguous run: on a PCIe link a 32 KiB page moves in ~0.65 us while a
 *    cuMemcpyAsync costs 5-7 us to submit, so merging runs and batching the submission is what
 *    reaches the link's bandwidth.
 */
#include "cuda_copy.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;
typedef struct {
    char reserved[64];
} CUipcHandle; /* CUipcMemHandle and CUipcEventHandle: 64 opaque bytes each */
typedef struct {
    char bytes[16];
} CUuuid;
typedef struct {
    int type; /* CUmemLocationType */
    int id;
} CUmemLocation;
typedef struct {
    int srcAccessOrder; /* CUmemcpySrcAccessOrder */
    CUmemLocation srcLocHint;
    CUmemLocation dstLocHint;
    unsigned int flags;
} CUmemcpyAttributes;

enum {
    CU_SRC_ORDER_STREAM = 1,
    CU_SRC_ORDER_ANY = 3,
    CU_EVENT_DISABLE_TIMING = 2,
    CU_EVENT_INTERPROCESS = 4,
    CU_STREAM_NON_BLOCKING = 1,
    CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1,
    CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10,
    CU_MEMHOSTREGISTER_PORTABLE = 1
};

typedef CUresult (*get_proc_v2_fn)(const char *, void **, int, uint64_t, int *);
typedef CUresult (*get_proc_v1_fn)(const char *, void **, int, uint64_t);

static struct {
    void *lib;
    const char *why; /* "" when usable */
    int version;
    CUresult (*init)(unsigned);
    CUresult (*driver_version)(int *);
    CUresult (*error_name)(CUresult, const char **);
    CUresult (*device_count)(int *);
    CUresult (*device_get)(CUdevice *, int);
    CUresult (*device_uuid)(CUuuid *, CUdevice);
    CUresult (*primary_retain)(CUcontext *, CUdevice);
    CUresult (*ctx_set)(CUcontext);
    CUresult (*priority_range)(int *, int *);
    CUresult (*stream_create)(CUstream *, unsigned, int);
    CUresult (*stream_sync)(CUstream);
    CUresult (*stream_wait)(CUstream, CUevent, unsigned);
    CUresult (*stream_destroy)(CUstream);
    CUresult (*memcpy_async)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
    CUresult (*memcpy_batch)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, CUmemcpyAttributes *,
                             size_t *, size_t, size_t *, CUstream);
    CUresult (*addr_range)(CUdeviceptr *, size_t *, CUdeviceptr);
    CUresult (*ptr_attr)(void *, int, CUdeviceptr);
    CUresult (*ipc_get_mem)(CUipcHandle *, CUdeviceptr);
    CUresult (*ipc_open_mem)(CUdeviceptr *, CUipcHandle, unsigned);
    CUresult (*ipc_close_mem)(CUdeviceptr);
    CUresult (*event_create)(CUevent *, unsigned);
    CUresult (*ipc_get_event)(CUipcHandle *, CUevent);
    CUresult (*ipc_open_event)(CUevent *, CUipcHandle);
    CUresult (*event_record)(CUevent, CUstream);
    CUresult (*event_query)(CUevent);
    CUresult (*event_sync)(CUevent);
    CUresult (*event_destroy)(CUevent);
    CUresult (*host_register)(void *, size_t, unsigned);
    CUresult (*host_unregister)(void *);
    CUresult (*mem_get_info)(size_t *, size_t *);
} cu = {.why = "not loaded"};

static pthread_once_t cu_once = PTHREAD_ONCE_INIT;

static void *resolve(void *getproc, int v2, const char *name, int version)
{
    void *fn = NULL;
    if (v2) {
        int status = 0;
        if (((get_proc_v2_fn)getproc)(name, &fn, version, 0, &status) != 0)
            fn = NULL;
    } else if (((get_proc_v1_fn)getproc)(name, &fn, version, 0) != 0) {
        fn = NULL;
    }
    return fn;
}

#define NEED(field, name)                                                                          \
    do {                                                                                           \
        *(void **)&cu.field = resolve(gp, v2, name, 12000);                                        \
        if (!cu.field) {                                                                           \
            cu.why = "libcuda lacks " name;                                                        \
            return;                                                                                \
        }                                                                                          \
    } while (0)

static void load_driver(void)
{
    cu.lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!cu.lib) {
        cu.why = "no libcuda (libcuda.so.1 could not be loaded: no NVIDIA driver on this machine)";
        return;
    }
    int v2 = 1;
    void *gp = dlsym(cu.lib, "cuGetProcAddress_v2");
    if (!gp) {
        v2 = 0;
        gp = dlsym(cu.lib, "cuGetProcAddress");
    }
    if (!gp) {
        cu.why = "libcuda has no cuGetProcAddress (driver older than CUDA 11.3)";
        return;
    }
    NEED(init, "cuInit");
    NEED(driver_version, "cuDriverGetVersion");
    NEED(error_name, "cuGetErrorName");
    NEED(device_count, "cuDeviceGetCount");
    NEED(device_get, "cuDeviceGet");
    NEED(device_uuid, "cuDeviceGetUuid");
    NEED(primary_retain, "cuDevicePrimaryCtxRetain");
    NEED(ctx_set, "cuCtxSetCurrent");
    NEED(priority_range, "cuCtxGetStreamPriorityRange");
    NEED(stream_create, "cuStreamCreateWithPriority");
    NEED(stream_sync, "cuStreamSynchronize");
    NEED(stream_wait, "cuStreamWaitEvent");
    NEED(stream_destroy, "cuStreamDestroy");
    NEED(memcpy_async, "cuMemcpyAsync");
    NEED(addr_range, "cuMemGetAddressRange");
    NEED(ptr_attr, "cuPointerGetAttribute");
    NEED(ipc_get_mem, "cuIpcGetMemHandle");
    NEED(ipc_open_mem, "cuIpcOpenMemHandle");
    NEED(ipc_close_mem, "cuIpcCloseMemHandle");
    NEED(event_create, "cuEventCreate");
    NEED(ipc_get_event, "cuIpcGetEventHandle");
    NEED(ipc_open_event, "cuIpcOpenEventHandle");
    NEED(event_record, "cuEventRecord");
    NEED(event_query, "cuEventQuery");
    NEED(event_sync, "cuEventSynchronize");
    NEED(event_destroy, "cuEventDestroy");
    NEED(host_register, "cuMemHostRegister");
    NEED(host_unregister, "cuMemHostUnregister");
    NEED(mem_get_info, "cuMemGetInfo");
    *(void **)&cu.memcpy_batch = resolve(gp, v2, "cuMemcpyBatchAsync", 12080); /* may be absent */
    CUresult rc = cu.init(0);
    if (rc != 0) {
        cu.why =
            rc == 100 ? "cuInit failed: no CUDA device (CUDA_ERROR_NO_DEVICE)" : "cuInit failed";
        return;
    }
    cu.driver_version(&cu.version);
    cu.why = "";
}

const char *hpkv_cuda_available(void)
{
    pthread_once(&cu_once, load_driver);
    return cu.why;
}

#define LOADED()                                                                                   \
    do {                                                                                           \
        if (*hpkv_cuda_available())                                                                \
            return HPKV_CU_NOT_LOADED;                                                             \
    } while (0)

int hpkv_cuda_driver_version(void)
{
    hpkv_cuda_available();
    return cu.version;
}

int hpkv_cuda_has_batch(void)
{
    return !*hpkv_cuda_available() && cu.memcpy_batch != NULL;
}

const char *hpkv_cuda_error_name(int rc)
{
    const char *s = NULL;
    if (rc == HPKV_CU_NOT_LOADED)
        return hpkv_cuda_available();
    if (*hpkv_cuda_available() || cu.error_name(rc, &s) != 0 || !s)
        return "unknown CUDA error";
    return s;
}

int64_t hpkv_cuda_plan(const hpkv_layout *layout, uint64_t dev_lo, uint64_t dev_hi,
                       uint64_t pool_base, uint64_t slot_stride, uint64_t num_slots,
                       const int64_t *dev_blocks, const int64_t *slots, uint64_t n, int direction,
                       uint64_t *dst, uint64_t *src, uint64_t *size, uint64_t cap)
{
    if (!layout || (direction != HPKV_SAVE && direction != HPKV_LOAD))
        return HPKV_COPY_EARG;
    if (n == 0)
        return 0;
    const uint64_t L = layout->num_layers, page = layout->page_bytes, nb = layout->num_blocks;
    if (!pool_base || !dev_blocks || !slots || !layout->layer_base || !dst || !src || !size ||
        L == 0 || slot_stride / L < page || cap / L < n || nb == 0)
        return HPKV_COPY_EARG;
    /* Every layer's whole span must lie in the imported allocation: then any id < nb is safe. */
    const uint64_t span = (nb - 1) * layout->block_stride + page;
    for (uint64_t l = 0; l < L; l++) {
        const uint64_t b = layout->layer_base[l];
        if (b < dev_lo || b > dev_hi || dev_hi - b < span)
            return HPKV_COPY_EARG;
    }
    for (uint64_t i = 0; i < n; i++) {
        if ((uint64_t)dev_blocks[i] >= nb)
            return HPKV_COPY_EBLOCK - (int64_t)(HPKV_COPY_ERR_STRIDE * i);
        if ((uint64_t)slots[i] >= num_slots)
            return HPKV_COPY_ESLOT - (int64_t)(HPKV_COPY_ERR_STRIDE * i);
    }
    uint64_t k = 0;
    for (uint64_t i = 0; i < n; i++) {
        /* ids may live in shared memory a peer rewrites: read once, check again */
        const uint64_t b = (uint64_t)__atomic_load_n(&dev_blocks[i], __ATOMIC_RELAXED);
        const uint64_t s = (uint64_t)__atomic_load_n(&slots[i], __ATOMIC_RELAXED);
        if (b >= nb || s >= num_slots)
            return (b >= nb ? HPKV_COPY_EBLOCK : HPKV_COPY_ESLOT) -
                   (int64_t)(HPKV_COPY_ERR_STRIDE * i);
        const uint64_t slot = pool_base + s * slot_stride;
        for (uint64_t l = 0; l < L; l++) {
            const uint64_t dev = layout->layer_base[l] + b * layout->block_stride;
            const uint64_t pool = slot + l * page;
            const uint64_t d = direction == HPKV_SAVE ? pool : dev;
            const uint64_t sr = direction == HPKV_SAVE ? dev : pool;
            if (k && dst[k - 1] + size[k - 1] == d && src[k - 1] + size[k - 1] == sr) {
                size[k - 1] += page; /* continues the previous run on both sides */
                continue;
            }
            dst[k] = d;
            src[k] = sr;
            size[k] = page;
            k++;
        }
    }
    return (int64_t)k;
}

void hpkv_desc_memcpy(const uint64_t *dst, const uint64_t *src, const uint64_t *size, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++)
        memcpy((void *)(uintptr_t)dst[i], (const void *)(uintptr_t)src[i], size[i]);
}

int64_t hpkv_cuda_copy_blocks(const hpkv_layout *layout, uint64_t dev_lo, uint64_t dev_hi,
                              uint64_t pool_base, uint64_t slot_stride, uint64_t num_slots,
                              const int64_t *dev_blocks, const int64_t *slots, uint64_t n,
                              int direction, uint64_t stream, uint64_t *dst, uint64_t *src,
                              uint64_t *size, uint64_t cap, int *cu_err)
{
    *cu_err = 0;
    if (*hpkv_cuda_available()) {
        *cu_err = HPKV_CU_NOT_LOADED;
        return HPKV_COPY_EARG;
    }
    const int64_t k = hpkv_cuda_plan(layout, dev_lo, dev_hi, pool_base, slot_stride, num_slots,
                                     dev_blocks, slots, n, direction, dst, src, size, cap);
    if (k <= 0)
        return k;
    CUstream st = (CUstream)(uintptr_t)stream;
    /* The batch call rejects the legacy default stream (0): that one takes the loop. */
    if (cu.memcpy_batch && st) {
        CUmemcpyAttributes attr;
        memset(&attr, 0, sizeof attr);
        attr.srcAccessOrder = direction == HPKV_SAVE ? CU_SRC_ORDER_STREAM : CU_SRC_ORDER_ANY;
        size_t attr_idx = 0, fail_idx = 0;
        CUresult rc = cu.memcpy_batch((CUdeviceptr *)dst, (CUdeviceptr *)src, (size_t *)size,
                                      (size_t)k, &attr, &attr_idx, 1, &fail_idx, st);
        if (rc == 0)
            return k;
        if (rc != 801) { /* CUDA_ERROR_NOT_SUPPORTED: fall through to the loop */
            *cu_err = rc;
            return k;
        }
    }
    for (int64_t i = 0; i < k; i++) {
        CUresult rc = cu.memcpy_async(dst[i], src[i], size[i], st);
        if (rc != 0) {
            *cu_err = rc;
            break;
        }
    }
    return k;
}

int hpkv_cuda_device_by_uuid(const uint8_t *uuid16, int *ordinal)
{
    LOADED();
    int count = 0;
    CUresult rc = cu.device_count(&count);
    for (int i = 0; rc == 0 && i < count; i++) {
        CUdevice dev;
        CUuuid u;
        if ((rc = cu.device_get(&dev, i)) != 0 || (rc = cu.device_uuid(&u, dev)) != 0)
            break;
        if (memcmp(u.bytes, uuid16, 16) == 0) {
            *ordinal = i;
            return 0;
        }
    }
    return rc ? rc : 101; /* CUDA_ERROR_INVALID_DEVICE: no device has this UUID here */
}

int hpkv_cuda_device_uuid(int ordinal, uint8_t *uuid16)
{
    LOADED();
    CUdevice dev;
    CUuuid u;
    CUresult rc = cu.device_get(&dev, ordinal);
    if (rc == 0 && (rc = cu.device_uuid(&u, dev)) == 0)
        memcpy(uuid16, u.bytes, 16);
    return rc;
}

int hpkv_cuda_ctx_bind(int ordinal)
{
    LOADED();
    CUdevice dev;
    CUcontext ctx;
    CUresult rc = cu.device_get(&dev, ordinal);
    if (rc == 0 && (rc = cu.primary_retain(&ctx, dev)) == 0)
        rc = cu.ctx_set(ctx);
    return rc;
}

int hpkv_cuda_stream_create(int low_priority, uint64_t *stream)
{
    LOADED();
    int least = 0, greatest = 0;
    CUresult rc = cu.priority_range(&least, &greatest);
    if (rc != 0)
        return rc;
    CUstream st = NULL;
    rc = cu.stream_create(&st, CU_STREAM_NON_BLOCKING, low_priority ? least : greatest);
    *stream = (uint64_t)(uintptr_t)st;
    return rc;
}

int hpkv_cuda_stream_sync(uint64_t stream)
{
    LOADED();
    return cu.stream_sync((CUstream)(uintptr_t)stream);
}

int hpkv_cuda_stream_wait_event(uint64_t stream, uint64_t event)
{
    LOADED();
    return cu.stream_wait((CUstream)(uintptr_t)stream, (CUevent)(uintptr_t)event, 0);
}

int hpkv_cuda_stream_destroy(uint64_t stream)
{
    LOADED();
    return cu.stream_destroy((CUstream)(uintptr_t)stream);
}

int hpkv_cuda_mem_export(uint64_t ptr, uint8_t *handle64, uint64_t *alloc_base,
                         uint64_t *alloc_bytes, int *ipc_capable)
{
    LOADED();
    CUdeviceptr base = 0;
    size_t bytes = 0;
    int capable = 0;
    CUresult rc = cu.addr_range(&base, &bytes, (CUdeviceptr)ptr);
    if (rc != 0)
        return rc;
    *alloc_base = base;
    *alloc_bytes = bytes;
    /* cuMem (VMM) allocations, e.g. vLLM sleep mode or expandable segments, are not legacy-IPC capable */
    if (cu.ptr_attr(&capable, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, base) != 0)
        capable = 1; /* older drivers lack the attribute; the export below then decides */
    *ipc_capable = capable;
    if (!capable)
        return 0;
    CUipcHandle h;
    rc = cu.ipc_get_mem(&h, base);
    if (rc == 0)
        memcpy(handle64, h.reserved, 64);
    return rc;
}

int hpkv_cuda_mem_import(const uint8_t *handle64, uint64_t *dptr)
{
    LOADED();
    CUipcHandle h;
    CUdeviceptr p = 0;
    memcpy(h.reserved, handle64, 64);
    CUresult rc = cu.ipc_open_mem(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    *dptr = p;
    return rc;
}

int hpkv_cuda_mem_close(uint64_t dptr)
{
    LOADED();
    return cu.ipc_close_mem((CUdeviceptr)dptr);
}

int hpkv_cuda_event_create(int interprocess, uint64_t *event)
{
    LOADED();
    CUevent ev = NULL;
    CUresult rc =
        cu.event_create(&ev, CU_EVENT_DISABLE_TIMING | (interprocess ? CU_EVENT_INTERPROCESS : 0));
    *event = (uint64_t)(uintptr_t)ev;
    return rc;
}

int hpkv_cuda_event_export(uint64_t event, uint8_t *handle64)
{
    LOADED();
    CUipcHandle h;
    CUresult rc = cu.ipc_get_event(&h, (CUevent)(uintptr_t)event);
    if (rc == 0)
        memcpy(handle64, h.reserved, 64);
    return rc;
}

int hpkv_cuda_event_import(const uint8_t *handle64, uint64_t *event)
{
    LOADED();
    CUipcHandle h;
    CUevent ev = NULL;
    memcpy(h.reserved, handle64, 64);
    CUresult rc = cu.ipc_open_event(&ev, h);
    *event = (uint64_t)(uintptr_t)ev;
    return rc;
}

int hpkv_cuda_event_record(uint64_t event, uint64_t stream)
{
    LOADED();
    return cu.event_record((CUevent)(uintptr_t)event, (CUstream)(uintptr_t)stream);
}

int hpkv_cuda_event_query(uint64_t event)
{
    LOADED();
    return cu.event_query((CUevent)(uintptr_t)event);
}

int hpkv_cuda_event_sync(uint64_t event)
{
    LOADED();
    return cu.event_sync((CUevent)(uintptr_t)event);
}

int hpkv_cuda_event_destroy(uint64_t event)
{
    LOADED();
    return cu.event_destroy((CUevent)(uintptr_t)event);
}

int hpkv_cuda_host_register(uint64_t ptr, uint64_t bytes)
{
    LOADED();
    return cu.host_register((void *)(uintptr_t)ptr, (size_t)bytes, CU_MEMHOSTREGISTER_PORTABLE);
}

int hpkv_cuda_host_unregister(uint64_t ptr)
{
    LOADED();
    return cu.host_unregister((void *)(uintptr_t)ptr);
}

int hpkv_cuda_mem_get_info(uint64_t *free_bytes, uint64_t *total_bytes)
{
    LOADED();
    size_t f = 0, t = 0;
    CUresult rc = cu.mem_get_info(&f, &t);
    *free_bytes = f;
    *total_bytes = t;
    return rc;
}
