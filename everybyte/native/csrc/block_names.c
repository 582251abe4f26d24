/* KV block names (kv/block_id.chain_block_ids) in one call: BLAKE2b (RFC 7693) with a 16-byte
 * digest and the personalization hashlib is given, over prefix || parent || the block's tokens as
 * little-endian int32, each block's name the next block's parent. hashlib stays the reference.
 *
 * chain(prefix, parent, tokens, start, end, block_size, person) -> list[bytes]
 * names the blocks of tokens[start:end] (end - start a multiple of block_size); OverflowError
 * when a token does not fit an int32 (the caller then lets struct.pack say so).
 *
 * chain_mix(digest, parent, tokens, start, end, block_size) -> list[bytes]
 * the same chain with mix128 (kv/block_mix) instead of BLAKE2b: for the simulator.
 *
 * common_prefix(a, b, limit) -> int
 * how many leading items of the lists a and b are equal, at most limit (kv/name_memo's check that
 * a new prompt starts with the context whose names it kept): no slices, and shared int objects
 * compare by identity before value. Built after name_hash.h (fmix64). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define OUT_BYTES 16

#pragma GCC optimize("O3", "unroll-loops")   /* the 12 rounds unrolled: SIGMA becomes constants */

typedef struct {
    uint64_t h[8], t;
    uint8_t buf[128];
    size_t fill;
} blake2b;

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};

static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

static inline uint64_t rotr(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t load64(const uint8_t *p) {
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
#else
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
#endif
}

#define G(a, b, c, d, x, y)                                                                              \
    do {                                                                                                 \
        v[a] = v[a] + v[b] + (x); v[d] = rotr(v[d] ^ v[a], 32);                                          \
        v[c] = v[c] + v[d];       v[b] = rotr(v[b] ^ v[c], 24);                                          \
        v[a] = v[a] + v[b] + (y); v[d] = rotr(v[d] ^ v[a], 16);                                          \
        v[c] = v[c] + v[d];       v[b] = rotr(v[b] ^ v[c], 63);                                          \
    } while (0)

static void compress(blake2b *s, int last) {
    uint64_t v[16], m[16];
    for (int i = 0; i < 8; i++) {
        v[i] = s->h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= s->t;                     /* messages here stay far below 2^64 bytes: no high counter */
    if (last)
        v[14] = ~v[14];
    for (int i = 0; i < 16; i++)
        m[i] = load64(s->buf + 8 * i);
    for (int r = 0; r < 12; r++) {
        const uint8_t *z = SIGMA[r];
        G(0, 4, 8, 12, m[z[0]], m[z[1]]);
        G(1, 5, 9, 13, m[z[2]], m[z[3]]);
        G(2, 6, 10, 14, m[z[4]], m[z[5]]);
        G(3, 7, 11, 15, m[z[6]], m[z[7]]);
        G(0, 5, 10, 15, m[z[8]], m[z[9]]);
        G(1, 6, 11, 12, m[z[10]], m[z[11]]);
        G(2, 7, 8, 13, m[z[12]], m[z[13]]);
        G(3, 4, 9, 14, m[z[14]], m[z[15]]);
    }
    for (int i = 0; i < 8; i++)
        s->h[i] ^= v[i] ^ v[i + 8];
}

static void init(blake2b *s, const uint8_t person[16]) {
    memcpy(s->h, IV, sizeof IV);
    s->h[0] ^= 0x01010000ULL | OUT_BYTES;          /* fanout 1, depth 1, no key */
    s->h[6] ^= load64(person);
    s->h[7] ^= load64(person + 8);
    s->t = 0;
    s->fill = 0;
}

static void update(blake2b *s, const uint8_t *p, size_t n) {
    while (n > 0) {
        if (s->fill == 128) {          /* compress a full buffer only once more input follows */
            s->t += 128;
            compress(s, 0);
            s->fill = 0;
        }
        size_t take = 128 - s->fill < n ? 128 - s->fill : n;
        memcpy(s->buf + s->fill, p, take);
        s->fill += take;
        p += take;
        n -= take;
    }
}

static void final(blake2b *s, uint8_t out[OUT_BYTES]) {
    s->t += s->fill;
    memset(s->buf + s->fill, 0, 128 - s->fill);
    compress(s, 1);
    for (int i = 0; i < OUT_BYTES; i++)
        out[i] = (uint8_t)(s->h[i / 8] >> (8 * (i % 8)));
}

/* an int that fits one internal digit (every token id), read without a call; 0: ask PyLong */
static inline int small_int(PyObject *o, long long *v) {
    if (!PyLong_CheckExact(o))
        return 0;
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)o))
        return 0;
    *v = (long long)PyUnstable_Long_CompactValue((PyLongObject *)o);
#else
    Py_ssize_t size = Py_SIZE(o);
    if (size < -1 || size > 1)
        return 0;
    *v = size * (long long)((PyLongObject *)o)->ob_digit[0];
#endif
    return 1;
}

static inline void store32(uint8_t *p, uint32_t u) {         /* little-endian */
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(p, &u, 4);
#else
    for (int b = 0; b < 4; b++)
        p[b] = (uint8_t)(u >> (8 * b));
#endif
}

/* an argument as a Py_ssize_t, as the "n" format reads it; -1 with an exception on failure */
static Py_ssize_t arg_ssize(PyObject *o) { return PyNumber_AsSsize_t(o, PyExc_OverflowError); }

/* ---- mix128: a fast name that is not collision-resistant against crafted input -------------------- */
static inline uint64_t rotl(uint64_t x, int n) { return (x << n) | (x >> (64 - n)); }
#define MIX_A 0x9e3779b97f4a7c15ULL
#define MIX_B 0xd6e8feb86659fd93ULL

/* two lanes over the 64-bit little-endian words of parent || tokens (an odd int32 count ends with a
 * zero-extended 32-bit word), each a bijective mix of (lane ^ word) / (lane + word), folded with the
 * byte length; kv/block_mix.py is the reference */
static void mix_block(const uint8_t digest[16], const uint8_t *parent, const uint8_t *tok, size_t nbytes,
                      uint8_t out[OUT_BYTES]) {
    uint64_t a = load64(digest) ^ MIX_A, b = load64(digest + 8) ^ MIX_B, w;
    for (int i = 0; i < 2; i++) {
        w = load64(parent + 8 * i);
        a = fmix64(a ^ w);
        b = fmix64(b + w);
    }
    size_t i = 0;
    for (; i + 8 <= nbytes; i += 8) {
        w = load64(tok + i);
        a = fmix64(a ^ w);
        b = fmix64(b + w);
    }
    if (i < nbytes) {                                  /* nbytes is a multiple of 4 */
        w = (uint64_t)tok[i] | (uint64_t)tok[i + 1] << 8 | (uint64_t)tok[i + 2] << 16 | (uint64_t)tok[i + 3] << 24;
        a = fmix64(a ^ w);
        b = fmix64(b + w);
    }
    uint64_t lo = fmix64(a ^ rotl(b, 29) ^ (uint64_t)nbytes), hi = fmix64(b ^ rotl(a, 17) ^ ((uint64_t)nbytes * MIX_A));
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(out, &lo, 8);
    memcpy(out + 8, &hi, 8);
#else
    for (int k = 0; k < 8; k++) {
        out[k] = (uint8_t)(lo >> (8 * k));
        out[8 + k] = (uint8_t)(hi >> (8 * k));
    }
#endif
}

/* METH_FASTCALL: the arguments are read here, not parsed from a format (that was a fifth of a call).
 * mix: chain_mix(digest, parent, tokens, start, end, block_size), else chain(..., person). */
static PyObject *chain_any(PyObject *const *args, Py_ssize_t nargs, int mix) {
    Py_buffer prefix = {0}, parent = {0}, person = {0};      /* .obj NULL: releasing is a no-op */
    PyObject *tokens, *out = NULL, *seq = NULL;
    Py_ssize_t start, end, bs;
    uint8_t *packed = NULL;
    if (nargs != (mix ? 6 : 7)) {
        PyErr_Format(PyExc_TypeError, "%s() takes %d arguments (%zd given)", mix ? "chain_mix" : "chain", mix ? 6 : 7,
                     nargs);
        return NULL;
    }
    tokens = args[2];
    if (PyObject_GetBuffer(args[0], &prefix, PyBUF_SIMPLE) < 0 || PyObject_GetBuffer(args[1], &parent, PyBUF_SIMPLE) < 0
        || (!mix && PyObject_GetBuffer(args[6], &person, PyBUF_SIMPLE) < 0))
        goto done;
    if (mix && prefix.len != 16) {
        PyErr_SetString(PyExc_ValueError, "chain_mix: the digest must be 16 bytes");
        goto done;
    }
    if ((start = arg_ssize(args[3])) == -1 && PyErr_Occurred())
        goto done;
    if ((end = arg_ssize(args[4])) == -1 && PyErr_Occurred())
        goto done;
    if ((bs = arg_ssize(args[5])) == -1 && PyErr_Occurred())
        goto done;
    if (parent.len != OUT_BYTES || person.len > 16 || bs < 1 || start < 0 || end < start || (end - start) % bs) {
        PyErr_SetString(PyExc_ValueError, "chain: bad parent, person or range");
        goto done;
    }
    seq = PySequence_Fast(tokens, "tokens must be a sequence of ints");
    if (!seq)
        goto done;
    if (end > PySequence_Fast_GET_SIZE(seq)) {
        PyErr_SetString(PyExc_ValueError, "chain: end past the tokens");
        goto done;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    packed = PyMem_Malloc((size_t)(end - start) * 4 + 1);
    if (!packed) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = start; i < end; i++) {
        long long v;
        if (!small_int(items[i], &v)) {
            v = PyLong_AsLongLong(items[i]);
            if (v == -1 && PyErr_Occurred())
                goto done;
            if (v < INT32_MIN || v > INT32_MAX) {
                PyErr_SetString(PyExc_OverflowError, "chain: a token does not fit an int32");
                goto done;
            }
        }
        store32(packed + (i - start) * 4, (uint32_t)v);
    }
    uint8_t pers[16] = {0}, name[OUT_BYTES];
    if (!mix)
        memcpy(pers, person.buf, (size_t)person.len);
    memcpy(name, parent.buf, OUT_BYTES);
    Py_ssize_t n = (end - start) / bs;
    out = PyList_New(n);
    if (!out)
        goto done;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (mix) {
            uint8_t next[OUT_BYTES];
            mix_block(prefix.buf, name, packed + (size_t)k * bs * 4, (size_t)bs * 4, next);
            memcpy(name, next, OUT_BYTES);
        } else {
            blake2b s;
            init(&s, pers);
            update(&s, prefix.buf, (size_t)prefix.len);
            update(&s, name, OUT_BYTES);
            update(&s, packed + (size_t)k * bs * 4, (size_t)bs * 4);
            final(&s, name);
        }
        PyObject *b = PyBytes_FromStringAndSize((const char *)name, OUT_BYTES);
        if (!b) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, k, b);
    }
done:
    PyMem_Free(packed);
    Py_XDECREF(seq);
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&person);
    return out;
}

static PyObject *chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) { return chain_any(args, nargs, 0); }
static PyObject *chain_mix(PyObject *self, PyObject *const *args, Py_ssize_t nargs) { return chain_any(args, nargs, 1); }

static PyObject *common_prefix(PyObject *self, PyObject *args) {
    PyObject *a, *b;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "OOn", &a, &b, &limit))
        return NULL;
    PyObject *fa = PySequence_Fast(a, "common_prefix: a must be a sequence");
    PyObject *fb = fa ? PySequence_Fast(b, "common_prefix: b must be a sequence") : NULL;
    if (!fb) {
        Py_XDECREF(fa);
        return NULL;
    }
    Py_ssize_t i = 0;
    for (;;) {
        /* sizes and items are read again after each comparison: it may run code that changes them */
        Py_ssize_t n = PySequence_Fast_GET_SIZE(fa) < PySequence_Fast_GET_SIZE(fb) ? PySequence_Fast_GET_SIZE(fa)
                                                                                   : PySequence_Fast_GET_SIZE(fb);
        if (limit < n)
            n = limit;
        PyObject **xa = PySequence_Fast_ITEMS(fa), **xb = PySequence_Fast_ITEMS(fb);
        while (i < n && xa[i] == xb[i])
            i++;
        if (i >= n)
            break;
        PyObject *x = xa[i], *y = xb[i];
        Py_INCREF(x);
        Py_INCREF(y);
        int eq = PyObject_RichCompareBool(x, y, Py_EQ);
        Py_DECREF(x);
        Py_DECREF(y);
        if (eq < 0) {
            Py_DECREF(fa);
            Py_DECREF(fb);
            return NULL;
        }
        if (!eq)
            break;
        i++;
    }
    Py_DECREF(fa);
    Py_DECREF(fb);
    return PyLong_FromSsize_t(i);
}

static PyMethodDef METHODS[] = {
    {"common_prefix", common_prefix, METH_VARARGS, "common_prefix(a, b, limit) -> leading equal items"},
    {"chain_mix", (PyCFunction)(void (*)(void))chain_mix, METH_FASTCALL,
     "chain_mix(digest, parent, tokens, start, end, block_size) -> mix128 names (kv/block_mix)"},
    {"chain", (PyCFunction)(void (*)(void))chain, METH_FASTCALL, "chain(prefix, parent, tokens, start, end, block_size, person) -> names"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "block_names", NULL, -1, METHODS};

PyMODINIT_FUNC PyInit_block_names(void) { return PyModule_Create(&MODULE); }
