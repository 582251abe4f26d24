/* Counts per block name in C: kv/name_counts.NameCounts (a dict of bytes -> int) as an open-
 * addressing table keyed by a hash of the name's bytes, so counting a turn's new names costs no
 * siphash, no dict insert and no int object each (a fifth of a session's record_context before).
 *
 * NameCounts(): add(names, start, delta): counts[n] += delta for each n in names[start:] (an
 * absent name counts 0 when delta > 0, else it is a KeyError), removed at 0 or less; get(name)
 * -> int (0 when absent); keys() -> list; counts[name] (KeyError when absent); len(); `in`.
 * Keys must be bytes. Built after name_hash.h (fmix64, bytes_hash, shift_moves). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    PyObject *key;          /* bytes (owned); NULL: a free slot */
    uint64_t h;
    long long count;
} Slot;

typedef struct {
    PyObject_HEAD
    Slot *slots;
    Py_ssize_t cap, len;    /* cap: a power of two */
} Counts;

/* the slot holding key, or the free slot where it would go */
static Slot *find(Counts *c, PyObject *key, uint64_t h) {
    const char *p = PyBytes_AS_STRING(key);
    Py_ssize_t n = PyBytes_GET_SIZE(key), mask = c->cap - 1, i = (Py_ssize_t)(h & (uint64_t)mask);
    for (;; i = (i + 1) & mask) {
        Slot *s = &c->slots[i];
        if (!s->key) return s;
        if (s->key == key) return s;
        if (s->h == h && PyBytes_GET_SIZE(s->key) == n && memcmp(PyBytes_AS_STRING(s->key), p, (size_t)n) == 0) return s;
    }
}

static int grow(Counts *c) {
    Py_ssize_t cap = c->cap ? 2 * c->cap : 64;
    Slot *old = c->slots, *fresh = PyMem_Calloc((size_t)cap, sizeof(Slot));
    if (!fresh) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t oldcap = c->cap;
    c->slots = fresh;
    c->cap = cap;
    for (Py_ssize_t i = 0; i < oldcap; i++)
        if (old[i].key) {
            Slot *s = &fresh[old[i].h & (uint64_t)(cap - 1)];
            while (s->key) s = s == &fresh[cap - 1] ? fresh : s + 1;
            *s = old[i];
        }
    PyMem_Free(old);
    return 0;
}

/* backward-shift deletion: later entries of the probe run move up, so lookups need no tombstones */
static void remove_slot(Counts *c, Slot *s) {
    Py_ssize_t mask = c->cap - 1, i = s - c->slots, j = i;
    Py_DECREF(s->key);
    for (;;) {
        j = (j + 1) & mask;
        Slot *t = &c->slots[j];
        if (!t->key) break;
        Py_ssize_t home = (Py_ssize_t)(t->h & (uint64_t)mask);
        if (shift_moves(i, j, home)) {
            c->slots[i] = *t;
            i = j;
        }
    }
    c->slots[i].key = NULL;
    c->len--;
}

static int check_key(PyObject *key) {
    if (PyBytes_Check(key)) return 0;
    PyErr_Format(PyExc_TypeError, "a block name must be bytes, not %.100s", Py_TYPE(key)->tp_name);
    return -1;
}

static PyObject *Counts_add(Counts *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "add() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    Py_ssize_t start = PyNumber_AsSsize_t(args[1], PyExc_OverflowError), delta;
    if (start == -1 && PyErr_Occurred()) return NULL;
    if ((delta = PyNumber_AsSsize_t(args[2], PyExc_OverflowError)) == -1 && PyErr_Occurred()) return NULL;
    PyObject *fast = PySequence_Fast(args[0], "add: names must be a sequence");
    if (!fast) return NULL;
    for (Py_ssize_t i = start < 0 ? 0 : start; i < PySequence_Fast_GET_SIZE(fast); i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(fast, i);
        if (check_key(key) < 0) goto fail;
        if (2 * (c->len + 1) > c->cap && grow(c) < 0) goto fail;     /* at most half full */
        uint64_t h = bytes_hash(PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key));
        Slot *s = find(c, key, h);
        if (!s->key) {
            if (delta <= 0) {
                PyErr_SetObject(PyExc_KeyError, key);
                goto fail;
            }
            Py_INCREF(key);
            *s = (Slot){key, h, delta};
            c->len++;
        } else if ((s->count += delta) <= 0)
            remove_slot(c, s);
    }
    Py_DECREF(fast);
    Py_RETURN_NONE;
fail:
    Py_DECREF(fast);
    return NULL;
}

static Slot *lookup(Counts *c, PyObject *key) {         /* NULL: absent (or not bytes, error set) */
    if (check_key(key) < 0 || !c->cap) return NULL;
    Slot *s = find(c, key, bytes_hash(PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key)));
    return s->key ? s : NULL;
}

static PyObject *Counts_get(Counts *c, PyObject *key) {
    Slot *s = lookup(c, key);
    if (!s && PyErr_Occurred()) return NULL;
    return PyLong_FromLongLong(s ? s->count : 0);
}

static PyObject *Counts_keys(Counts *c, PyObject *unused) {
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = 0; out && i < c->cap; i++)
        if (c->slots[i].key && PyList_Append(out, c->slots[i].key) < 0) Py_CLEAR(out);
    return out;
}

static PyObject *Counts_subscript(Counts *c, PyObject *key) {
    Slot *s = lookup(c, key);
    if (!s) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    return PyLong_FromLongLong(s->count);
}

static int Counts_contains(Counts *c, PyObject *key) {
    Slot *s = lookup(c, key);
    return s ? 1 : PyErr_Occurred() ? -1 : 0;
}

static Py_ssize_t Counts_len(Counts *c) { return c->len; }

static int Counts_clear(Counts *c) {
    for (Py_ssize_t i = 0; i < c->cap; i++) Py_CLEAR(c->slots[i].key);
    c->len = 0;
    return 0;
}

static void Counts_dealloc(Counts *c) {
    Counts_clear(c);
    PyMem_Free(c->slots);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyMethodDef Counts_methods[] = {
    {"add", (PyCFunction)(void (*)(void))Counts_add, METH_FASTCALL, "add(names, start, delta)"},
    {"get", (PyCFunction)Counts_get, METH_O, "get(name) -> its count, 0 when absent"},
    {"keys", (PyCFunction)Counts_keys, METH_NOARGS, "the names counted"},
    {NULL}};

static PyMappingMethods Counts_mapping = {(lenfunc)Counts_len, (binaryfunc)Counts_subscript, NULL};
static PySequenceMethods Counts_seq = {.sq_contains = (objobjproc)Counts_contains};

static PyTypeObject CountsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "name_counts.NameCounts",
    .tp_basicsize = sizeof(Counts),
    .tp_flags = Py_TPFLAGS_DEFAULT,          /* it holds only bytes: no cycles through it */
    .tp_doc = "Counts per block name (see kv/name_counts.py).",
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)Counts_dealloc,
    .tp_methods = Counts_methods,
    .tp_as_mapping = &Counts_mapping,
    .tp_as_sequence = &Counts_seq,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "name_counts", NULL, -1, NULL};

PyMODINIT_FUNC PyInit_name_counts(void) {
    if (PyType_Ready(&CountsType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&CountsType);
    if (PyModule_AddObject(m, "NameCounts", (PyObject *)&CountsType) < 0) {
        Py_DECREF(&CountsType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
