/* CRC32C (contract in checksum.h).
 *
 * Hardware path: `crc32q` has a latency of 3 cycles and a throughput of 1 per
 * cycle, so one dependency chain gets a third of the instruction's throughput.
 * Long buffers are cut into three adjacent chunks whose CRCs run interleaved and
 * are combined by "appending zeros" with 4x256 lookup tables (Mark Adler's
 * method, crc32c.c on Stack Overflow q. 17645167): crc(A||B) = shift(crc(A), |B|)
 * ^ crc0(B) on the un-inverted register. PCLMUL would be faster to combine but is
 * not in x86-64-v2, and the tables cost ~10 ns per 24 KiB.
 */
#include "checksum.h"

#include <pthread.h>
#include <stddef.h>
#include <string.h>

#define POLY 0x82f63b78u

/* ---- table (slicing-by-8) path ---------------------------------------- */

static uint32_t sw_table[8][256];

static void sw_init(void)
{
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        sw_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = sw_table[0][n];
        for (int k = 1; k < 8; k++) {
            c = sw_table[0][c & 0xff] ^ (c >> 8);
            sw_table[k][n] = c;
        }
    }
}

static pthread_once_t sw_once = PTHREAD_ONCE_INIT;

static inline uint64_t load64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8); /* unaligned-safe; compiles to one mov */
    return v;
}

uint32_t hpkv_crc32c_sw(uint32_t crc, const void *buf, uint64_t len)
{
    pthread_once(&sw_once, sw_init);
    const unsigned char *p = buf;
    uint64_t c = crc ^ 0xffffffffu;
    while (len && ((uintptr_t)p & 7)) {
        c = sw_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
        len--;
    }
    while (len >= 8) {
        uint64_t w = load64(p);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        w = __builtin_bswap64(w);
#endif
        w ^= c;
        c = sw_table[7][w & 0xff] ^ sw_table[6][(w >> 8) & 0xff] ^ sw_table[5][(w >> 16) & 0xff] ^
            sw_table[4][(w >> 24) & 0xff] ^ sw_table[3][(w >> 32) & 0xff] ^
            sw_table[2][(w >> 40) & 0xff] ^ sw_table[1][(w >> 48) & 0xff] ^ sw_table[0][w >> 56];
        p += 8;
        len -= 8;
    }
    while (len--)
        c = sw_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    return (uint32_t)c ^ 0xffffffffu;
}

/* ---- hardware (SSE4.2) path ------------------------------------------- */

#ifdef __SSE4_2__
#include <nmmintrin.h>

/* GF(2) 32x32 matrix helpers, used once to build the shift tables. */
static uint32_t gf2_times(const uint32_t *mat, uint32_t vec)
{
    uint32_t sum = 0;
    for (; vec; vec >>= 1, mat++)
        if (vec & 1)
            sum ^= *mat;
    return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat)
{
    for (int n = 0; n < 32; n++)
        square[n] = gf2_times(mat, mat[n]);
}

/* Operator that appends len zero bytes (len a power of two >= 1) to a raw CRC register. */
static void zeros_op(uint32_t *even, uint64_t len)
{
    uint32_t odd[32];
    odd[0] = POLY; /* one zero bit */
    for (int n = 1; n < 32; n++)
        odd[n] = 1u << (n - 1);
    gf2_square(even, odd); /* two bits */
    gf2_square(odd, even); /* four bits */
    /* each square doubles: even = 1 byte, odd = 2 bytes, ... until len is consumed */
    do {
        gf2_square(even, odd);
        len >>= 1;
        if (len == 0)
            return;
        gf2_square(odd, even);
        len >>= 1;
    } while (len);
    memcpy(even, odd, sizeof(odd));
}

static void zeros_table(uint32_t zeros[4][256], uint64_t len)
{
    uint32_t op[32];
    zeros_op(op, len);
    for (uint32_t n = 0; n < 256; n++)
        for (int k = 0; k < 4; k++)
            zeros[k][n] = gf2_times(op, n << (8 * k));
}

static inline uint32_t shift(const uint32_t zeros[4][256], uint32_t crc)
{
    return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^ zeros[2][(crc >> 16) & 0xff] ^
           zeros[3][crc >> 24];
}

/* Chunk sizes of the three-way loops (powers of two). LONG amortizes the combine;
 * SHORT keeps mid-size buffers (a few KiB) on the parallel path too. */
#define LONG 8192
#define SHORT 256

static uint32_t long_shift[4][256];
static uint32_t short_shift[4][256];
static pthread_once_t hw_once = PTHREAD_ONCE_INIT;

static void hw_init(void)
{
    zeros_table(long_shift, LONG);
    zeros_table(short_shift, SHORT);
}

/* three interleaved chains over [p, p+3*chunk); returns the combined raw register */
static inline uint64_t crc3(uint64_t c0, const unsigned char *p, uint64_t chunk,
                            const uint32_t zeros[4][256])
{
    uint64_t c1 = 0, c2 = 0;
    const unsigned char *end = p + chunk;
    do {
        c0 = _mm_crc32_u64(c0, load64(p));
        c1 = _mm_crc32_u64(c1, load64(p + chunk));
        c2 = _mm_crc32_u64(c2, load64(p + 2 * chunk));
        p += 8;
    } while (p < end);
    c0 = shift(zeros, (uint32_t)c0) ^ c1;
    return shift(zeros, (uint32_t)c0) ^ c2;
}

uint32_t hpkv_crc32c(uint32_t crc, const void *buf, uint64_t len)
{
    const unsigned char *p = buf;
    uint64_t c = crc ^ 0xffffffffu;

    while (len && ((uintptr_t)p & 7)) { /* align so the 8-byte loads never split a line */
        c = _mm_crc32_u8((uint32_t)c, *p++);
        len--;
    }
    if (len >= 3 * SHORT) {
        pthread_once(&hw_once, hw_init);
        while (len >= 3 * LONG) {
            c = crc3(c, p, LONG, long_shift);
            p += 3 * LONG;
            len -= 3 * LONG;
        }
        while (len >= 3 * SHORT) {
            c = crc3(c, p, SHORT, short_shift);
            p += 3 * SHORT;
            len -= 3 * SHORT;
        }
    }
    while (len >= 8) {
        c = _mm_crc32_u64(c, load64(p));
        p += 8;
        len -= 8;
    }
    while (len--)
        c = _mm_crc32_u8((uint32_t)c, *p++);
    return (uint32_t)c ^ 0xffffffffu;
}

#else /* portable build */

uint32_t hpkv_crc32c(uint32_t crc, const void *buf, uint64_t len)
{
    return hpkv_crc32c_sw(crc, buf, len);
}

#endif

/* ---- checksum while copying ------------------------------------------- */

/* 64 KiB: a chunk summed from memory is still in L2 when memcpy reads it. */
#define CRC_COPY_CHUNK (64u << 10)

uint32_t hpkv_crc32c_copy(uint32_t crc, void *dst, const void *src, uint64_t len)
{
    const unsigned char *s = src;
    unsigned char *d = dst;
    while (len) {
        uint64_t n = len < CRC_COPY_CHUNK ? len : CRC_COPY_CHUNK;
        crc = hpkv_crc32c(crc, s, n);
        memcpy(d, s, n);
        s += n;
        d += n;
        len -= n;
    }
    return crc;
}
