/* hpkv checksum: CRC32C (Castagnoli, reflected polynomial 0x82F63B78), as used by
 * iSCSI/ext4/RocksDB; crc32c(b"123456789") == 0xE3069283.
 *
 * Contract: hpkv_crc32c(crc, buf, len) returns the CRC32C of the bytes that gave
 * `crc` followed by buf[0..len); start with crc = 0. Any alignment, any length
 * (len 0 returns crc unchanged); buf may be NULL only when len is 0. Thread-safe.
 * Built with SSE4.2 (the x86-64-v2 build), it runs three interleaved `crc32`
 * streams combined with GF(2) shift tables; elsewhere a slicing-by-8 table loop.
 */
#ifndef HPKV_CHECKSUM_H
#define HPKV_CHECKSUM_H

#include <stdint.h>

uint32_t hpkv_crc32c(uint32_t crc, const void *buf, uint64_t len);

/* hpkv_crc32c(crc, src, len), and src[0..len) copied to dst (no overlap) on the way: chunk
 * by chunk, so the source is read from memory once, not once to sum and once to copy. */
uint32_t hpkv_crc32c_copy(uint32_t crc, void *dst, const void *src, uint64_t len);

/* Table-driven path, always compiled: for tests and non-SSE4.2 hosts. */
uint32_t hpkv_crc32c_sw(uint32_t crc, const void *buf, uint64_t len);

#endif
