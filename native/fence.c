/* hpkv slot fence (contract in fence.h). */
#include "fence.h"

static inline uint32_t held(uint32_t gen, uint32_t holder)
{
    return (gen & HPKV_FENCE_GEN_MASK) | (holder << HPKV_FENCE_HOLDER_SHIFT);
}

static void give_back(uint32_t *words, uint64_t num_words, uint64_t unit, const int64_t *offsets,
                      const uint32_t *gens, uint64_t n, uint32_t holder)
{
    for (uint64_t i = 0; i < n; i++) {
        const uint64_t w = (uint64_t)offsets[i] / unit;
        if (w >= num_words)
            continue;
        uint32_t expect = held(gens[i], holder);
        /* release: the copy's stores (fenced by the copy) are visible before the slot is free;
         * a duplicate slot in one batch is given back once, the second CAS fails harmlessly */
        __atomic_compare_exchange_n(&words[w], &expect, gens[i] & HPKV_FENCE_GEN_MASK, 0,
                                    __ATOMIC_RELEASE, __ATOMIC_RELAXED);
    }
}

int64_t hpkv_fence_enter(uint32_t *words, uint64_t num_words, uint64_t unit, const int64_t *offsets,
                         const uint32_t *gens, uint64_t n, uint32_t holder)
{
    if (!words || !offsets || !gens || unit == 0 || holder == 0 || holder > 0xFF)
        return HPKV_FENCE_EARG;
    for (uint64_t i = 0; i < n; i++) {
        const uint64_t w = (uint64_t)offsets[i] / unit;
        const uint32_t gen = gens[i] & HPKV_FENCE_GEN_MASK;
        uint32_t expect = gen;
        /* acquire: no store of the copy moves before the slot is ours */
        if (w < num_words && (gens[i] == gen) &&
            __atomic_compare_exchange_n(&words[w], &expect, held(gen, holder), 0, __ATOMIC_ACQUIRE,
                                        __ATOMIC_RELAXED))
            continue;
        if (w < num_words && expect == held(gen, holder))
            continue; /* the same slot twice in this batch: already ours */
        give_back(words, num_words, unit, offsets, gens, i, holder);
        return -(int64_t)(i + 1);
    }
    return 0;
}

void hpkv_fence_leave(uint32_t *words, uint64_t num_words, uint64_t unit, const int64_t *offsets,
                      const uint32_t *gens, uint64_t n, uint32_t holder)
{
    if (words && offsets && gens && unit)
        give_back(words, num_words, unit, offsets, gens, n, holder);
}

int64_t hpkv_fence_bump(uint32_t *words, uint64_t num_words, uint64_t idx)
{
    if (!words || idx >= num_words)
        return -2;
    uint32_t cur = __atomic_load_n(&words[idx], __ATOMIC_ACQUIRE);
    for (;;) {
        if (cur >> HPKV_FENCE_HOLDER_SHIFT)
            return -1; /* a writer holds it: its copy may still be landing */
        const uint32_t next = (cur + 1) & HPKV_FENCE_GEN_MASK;
        /* acq_rel: every later use of the slot happens after the bump */
        if (__atomic_compare_exchange_n(&words[idx], &cur, next, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE))
            return next;
    }
}

uint64_t hpkv_fence_clear_holder(uint32_t *words, uint64_t num_words, uint32_t holder)
{
    uint64_t n = 0;
    if (!words || holder == 0)
        return 0;
    for (uint64_t i = 0; i < num_words; i++) {
        uint32_t cur = __atomic_load_n(&words[i], __ATOMIC_RELAXED);
        if (cur >> HPKV_FENCE_HOLDER_SHIFT != holder)
            continue;
        /* the holder is dead: nobody else writes a held word */
        __atomic_store_n(&words[i], cur & HPKV_FENCE_GEN_MASK, __ATOMIC_RELEASE);
        n++;
    }
    return n;
}
