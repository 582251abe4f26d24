/* The simulator's event queue in C: sim/event_queue.EventQueue (heapq over (time, kind, tie, n,
 * what) tuples) with the keys as C numbers, so ordering an event costs a few compares of doubles
 * and integers instead of tuple and float rich comparisons (a fifth of a push or pop before).
 *
 * EventQueue(): push(t, kind, tie, n, what); pop() -> (t, kind, n, what), the least (t, kind,
 * tie, n) first (IndexError when empty); first_time() -> t of the least, inf when empty; len().
 * n must be unique among the queued events (as the runner's counter is): `what` is never
 * compared. A NaN time is refused (ValueError). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

typedef struct {
    double t;
    long long kind, tie, n;
    PyObject *what;          /* owned */
} Event;

typedef struct {
    PyObject_HEAD
    Event *heap;
    Py_ssize_t len, cap;
} Queue;

static inline int less(const Event *a, const Event *b) {
    if (a->t != b->t) return a->t < b->t;
    if (a->kind != b->kind) return a->kind < b->kind;
    if (a->tie != b->tie) return a->tie < b->tie;
    return a->n < b->n;
}

static int arg_ll(PyObject *o, long long *out) {
    *out = PyLong_AsLongLong(o);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

static PyObject *Queue_push(Queue *q, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "push() takes 5 arguments (%zd given)", nargs);
        return NULL;
    }
    Event e;
    e.t = PyFloat_AsDouble(args[0]);
    if (e.t == -1.0 && PyErr_Occurred()) return NULL;
    if (isnan(e.t)) {
        PyErr_SetString(PyExc_ValueError, "an event time cannot be NaN");
        return NULL;
    }
    if (arg_ll(args[1], &e.kind) < 0 || arg_ll(args[2], &e.tie) < 0 || arg_ll(args[3], &e.n) < 0) return NULL;
    if (q->len == q->cap) {
        Py_ssize_t cap = q->cap ? 2 * q->cap : 256;
        Event *h = PyMem_Realloc(q->heap, (size_t)cap * sizeof(Event));
        if (!h) return PyErr_NoMemory();
        q->heap = h;
        q->cap = cap;
    }
    Py_INCREF(args[4]);
    e.what = args[4];
    Event *h = q->heap;
    Py_ssize_t i = q->len++;
    while (i > 0) {                              /* sift up: move parents down past the new entry */
        Py_ssize_t p = (i - 1) / 2;
        if (!less(&e, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = e;
    Py_RETURN_NONE;
}

static PyObject *Queue_pop(Queue *q, PyObject *unused) {
    if (q->len == 0) {
        PyErr_SetString(PyExc_IndexError, "pop from an empty event queue");
        return NULL;
    }
    Event *h = q->heap, top = h[0], last = h[--q->len];
    Py_ssize_t n = q->len, i = 0;
    if (n) {
        for (;;) {                               /* sift the last entry down from the root */
            Py_ssize_t c = 2 * i + 1;
            if (c >= n) break;
            if (c + 1 < n && less(&h[c + 1], &h[c])) c++;
            if (!less(&h[c], &last)) break;
            h[i] = h[c];
            i = c;
        }
        h[i] = last;
    }
    PyObject *out = Py_BuildValue("(dLLN)", top.t, top.kind, top.n, top.what);   /* steals what */
    if (!out) Py_DECREF(top.what);
    return out;
}

static PyObject *Queue_first_time(Queue *q, PyObject *unused) {
    return PyFloat_FromDouble(q->len ? q->heap[0].t : INFINITY);
}

static Py_ssize_t Queue_len(Queue *q) { return q->len; }

static int Queue_traverse(Queue *q, visitproc visit, void *arg) {
    for (Py_ssize_t i = 0; i < q->len; i++) Py_VISIT(q->heap[i].what);
    return 0;
}

static int Queue_clear(Queue *q) {
    Py_ssize_t n = q->len;
    q->len = 0;
    for (Py_ssize_t i = 0; i < n; i++) Py_CLEAR(q->heap[i].what);
    return 0;
}

static void Queue_dealloc(Queue *q) {
    PyObject_GC_UnTrack(q);
    Queue_clear(q);
    PyMem_Free(q->heap);
    Py_TYPE(q)->tp_free((PyObject *)q);
}

static PyMethodDef Queue_methods[] = {
    {"push", (PyCFunction)(void (*)(void))Queue_push, METH_FASTCALL, "push(t, kind, tie, n, what)"},
    {"pop", (PyCFunction)Queue_pop, METH_NOARGS, "the least event as (t, kind, n, what)"},
    {"first_time", (PyCFunction)Queue_first_time, METH_NOARGS, "the least event's time (inf when empty)"},
    {NULL}};

static PySequenceMethods Queue_seq = {.sq_length = (lenfunc)Queue_len};

static PyTypeObject QueueType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "event_queue.EventQueue",
    .tp_basicsize = sizeof(Queue),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The simulator's event queue (see sim/event_queue.py).",
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)Queue_dealloc,
    .tp_traverse = (traverseproc)Queue_traverse,
    .tp_clear = (inquiry)Queue_clear,
    .tp_methods = Queue_methods,
    .tp_as_sequence = &Queue_seq,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "event_queue", NULL, -1, NULL};

PyMODINIT_FUNC PyInit_event_queue(void) {
    if (PyType_Ready(&QueueType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&QueueType);
    if (PyModule_AddObject(m, "EventQueue", (PyObject *)&QueueType) < 0) {
        Py_DECREF(&QueueType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
