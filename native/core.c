#include "core.h"

int hpkv_native_abi(void)
{
    return HPKV_NATIVE_ABI;
}
