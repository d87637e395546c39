/* hpkv native core: build identity shared by every native module. */
#ifndef HPKV_CORE_H
#define HPKV_CORE_H

#include <stdint.h>

/* Bumped whenever a native struct layout or function signature changes, so a
 * stale build is detected at import instead of corrupting shared memory. */
#define HPKV_NATIVE_ABI 2

int hpkv_native_abi(void);

#endif
