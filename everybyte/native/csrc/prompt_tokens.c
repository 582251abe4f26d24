/* Synthetic prompt tokens (traces/tokens.SessionPrompts.content) in one pass: the same splitmix64
 * arithmetic as its numpy reference, on uint64 (which wraps like numpy's), returning a list.
 *
 * content(hash_ids, start, end, token_scale, rec_a, block_size, unhashed, ns_blocks, ns_unique,
 *         low, span) -> list[int]
 * For each scaled position s in [start, end): pos = s (or (int64)(s * token_scale)), block =
 * max(pos, rec_a) / block_size; x = (hash_ids[block] mod 2^64) * A + s while block is in range,
 * else unhashed + s; then mix, xor ns_blocks (hashed) or ns_unique, mix, token = low + x % span. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static const uint64_t MUL_A = 0x2545F4914F6CDD1DULL;

static inline uint64_t mix(uint64_t x) {
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

/* A synthetic vocabulary repeats its `span` values: each is one shared int object, so a prompt
 * allocates no ints and copies of prompts touch a few hot objects instead of millions of cold
 * ones (1M sessions). Rebuilt when another (low, span) asks; none above MAX_SHARED values. */
#define MAX_SHARED (1 << 20)
static PyObject **shared = NULL;
static unsigned long long shared_low = 0, shared_span = 0;

static int share_tokens(unsigned long long low, unsigned long long span) {
    if (span > MAX_SHARED)
        return 0;
    if (shared && shared_low == low && shared_span == span)
        return 1;
    PyObject **t = PyMem_Malloc((size_t)span * sizeof(PyObject *));
    if (!t) {
        PyErr_NoMemory();
        return -1;
    }
    for (unsigned long long i = 0; i < span; i++) {
        t[i] = PyLong_FromUnsignedLongLong(low + i);
        if (!t[i]) {
            while (i > 0)
                Py_DECREF(t[--i]);
            PyMem_Free(t);
            return -1;
        }
    }
    if (shared) {
        for (unsigned long long i = 0; i < shared_span; i++)
            Py_DECREF(shared[i]);
        PyMem_Free(shared);
    }
    shared = t;
    shared_low = low;
    shared_span = span;
    return 1;
}

/* METH_FASTCALL, read as the format "OLLdLLKKKKK" would (parsing that was a tenth of a call) */
static PyObject *content(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 11) {
        PyErr_Format(PyExc_TypeError, "content() takes 11 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *hash_ids = args[0];
    static const int at[4] = {1, 2, 4, 5};           /* start, end, rec_a, block_size */
    long long ll[4];
    for (int i = 0; i < 4; i++)
        if ((ll[i] = PyLong_AsLongLong(args[at[i]])) == -1 && PyErr_Occurred())
            return NULL;
    long long start = ll[0], end = ll[1], rec_a = ll[2], block_size = ll[3];
    double scale = PyFloat_AsDouble(args[3]);
    if (scale == -1.0 && PyErr_Occurred())
        return NULL;
    unsigned long long k[5];                         /* "K": any int, masked to 64 bits */
    for (int i = 0; i < 5; i++) {
        if (!PyLong_Check(args[6 + i])) {
            PyErr_Format(PyExc_TypeError, "content() argument %d must be int", 7 + i);
            return NULL;
        }
        k[i] = PyLong_AsUnsignedLongLongMask(args[6 + i]);
    }
    unsigned long long unhashed = k[0], ns_blocks = k[1], ns_unique = k[2], low = k[3], span = k[4];
    if (start < 0 || end < start || rec_a < 0 || block_size < 1 || span < 1) {
        PyErr_Format(PyExc_ValueError, "bad range: start %lld end %lld rec_a %lld block_size %lld span %llu",
                     start, end, rec_a, block_size, span);
        return NULL;
    }
    int use_shared = share_tokens(low, span);
    if (use_shared < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(hash_ids, "hash_ids must be a sequence of ints");
    if (!seq)
        return NULL;
    Py_ssize_t nh = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New((Py_ssize_t)(end - start));
    if (!out) {
        Py_DECREF(seq);
        return NULL;
    }
    long long cached_block = -1, block = 0, block_lo = 0, block_hi = 0;   /* block holds [lo, hi) */
    uint64_t cached_id = 0;
    if (scale == 1.0 && use_shared) {
        /* the common case, a block at a time: positions s < hi share max(s, rec_a)'s block, so its
           key and namespace are read once and the inner loop is the two mixes and a shared int */
        PyObject **dst = ((PyListObject *)out)->ob_item;
        for (long long s = start; s < end;) {
            long long at = s > rec_a ? s : rec_a;
            block = at / block_size;
            long long hi = (block + 1) * block_size, stop = hi < end ? hi : end;
            uint64_t base, ns;
            if (block < nh) {
                base = (uint64_t)PyLong_AsUnsignedLongLongMask(items[block]);
                if (base == (uint64_t)-1 && PyErr_Occurred()) {
                    Py_DECREF(out);
                    Py_DECREF(seq);
                    return NULL;
                }
                base *= MUL_A;
                ns = ns_blocks;
            } else {
                base = unhashed;
                ns = ns_unique;
            }
            for (; s < stop; s++) {
                PyObject *tok = shared[mix(mix(base + (uint64_t)s) ^ ns) % span];
                Py_INCREF(tok);
                dst[s - start] = tok;
            }
        }
        Py_DECREF(seq);
        return out;
    }
    for (long long s = start; s < end; s++) {
        long long pos = scale == 1.0 ? s : (long long)((double)s * scale);
        long long at = pos > rec_a ? pos : rec_a;
        if (at >= block_hi || at < block_lo || s == start) {      /* a division per block, not per token */
            block = at / block_size;
            block_lo = block * block_size;
            block_hi = block_lo + block_size;
        }
        uint64_t x;
        int hashed = block < nh;
        if (hashed) {
            if (block != cached_block) {
                cached_id = (uint64_t)PyLong_AsUnsignedLongLongMask(items[block]);
                if (cached_id == (uint64_t)-1 && PyErr_Occurred()) {
                    Py_DECREF(out);
                    Py_DECREF(seq);
                    return NULL;
                }
                cached_block = block;
            }
            x = cached_id * MUL_A;
        } else {
            x = unhashed;
        }
        x = mix(x + (uint64_t)s);
        x = mix(x ^ (hashed ? ns_blocks : ns_unique));
        PyObject *tok;
        if (use_shared) {
            tok = shared[x % span];
            Py_INCREF(tok);
        } else
            tok = PyLong_FromUnsignedLongLong(low + x % span);
        if (!tok) {
            Py_DECREF(out);
            Py_DECREF(seq);
            return NULL;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)(s - start), tok);
    }
    Py_DECREF(seq);
    return out;
}

static PyMethodDef methods[] = {
    {"content", (PyCFunction)(void (*)(void))content, METH_FASTCALL, "synthetic prompt tokens (see traces/tokens.SessionPrompts.content)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "prompt_tokens", NULL, -1, methods};

PyMODINIT_FUNC PyInit_prompt_tokens(void) { return PyModule_Create(&module); }
