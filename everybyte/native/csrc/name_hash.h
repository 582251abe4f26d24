/* Shared by the extension modules that hash block names or keep open-addressing tables of them
 * (block_names.c, name_counts.c, prefix_core.c): joined in front of their source by
 * native/loader.try_module(..., headers=("name_hash.h",)), so it is part of their build key. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static inline uint64_t fmix64(uint64_t x) {          /* MurmurHash3's 64-bit finalizer */
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    return x ^ (x >> 33);
}

/* a name's bytes hashed for a table (names are already uniform hashes; any bytes work) */
static inline uint64_t bytes_hash(const char *p, Py_ssize_t n) {
    uint64_t h = 0x9e3779b97f4a7c15ULL ^ (uint64_t)n, w;
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        memcpy(&w, p + i, 8);
        h = fmix64(h ^ w);
    }
    if (i < n) {
        w = 0;
        memcpy(&w, p + i, (size_t)(n - i));
        h = fmix64(h ^ w ^ 0xd6e8feb86659fd93ULL);
    }
    return h;
}

/* backward-shift deletion in linear probing: after slot i was emptied, the entry at j (whose home
   slot is `home`) moves up to i when i lies cyclically in [home, j) */
static inline int shift_moves(Py_ssize_t i, Py_ssize_t j, Py_ssize_t home) {
    return (j > i && (home <= i || home > j)) || (j < i && home <= i && home > j);
}
