/* The G1 prefix cache's control plane in C: kv/prefix_cache.PrefixCache with its default policy,
 * ParkedFirst(LRUPolicy()), and its session side (kv/prefix_sessions), decision for decision.
 * kv/prefix_core.py wraps it; the Python classes stay the reference (tests/test_prefix_core.py
 * drives both with the same random operations and compares every result).
 *
 * State per block id lives in one 64-byte struct (Blk: reference count, name, LRU links, parked
 * flag and tick, free tick, the first owners), the colder parts in arrays (more owners, the
 * block's int and (block, name) pair, its name's hash, its parked rank); names stay Python
 * bytes. A session (an owner other than None and SHARED)
 * gets a slot in a table: its blocks as a list of (block, generation) entries, an entry going
 * stale when the block is forgotten (its generation moves on), and whether it is parked with
 * which rank. Owners of a block are slot numbers in a small array. Nothing depends on the order
 * of owners or of a session's entries: a session's blocks are ordered by (free tick, block id),
 * as the reference orders them. The LRU is an intrusive list, the parked side a heap of runs
 * keyed by (-rank, first tick) as in kv/parked_runs. Built after name_hash.h (fmix64, bytes_hash,
 * shift_moves).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    double neg;             /* -rank */
    int64_t key;            /* the tick it entered the heap with (unique) */
    int32_t *blocks;
    int64_t *ticks;
    Py_ssize_t n, i;        /* i: first element not consumed */
} Run;

/* a slot of the name index: the block and the low half of its name's hash (its home slot and a
   tag), so a probe passing other names and a deletion shifting them read only the index, not
   their blocks' names and hashes (cache misses at scale) */
typedef struct { int32_t b; uint32_t lo; } Slot;

#define OWN_ANON (-1)        /* the owner None: requests without a session */
#define OWN_SHARED (-2)      /* SHARED: too many owners to track */
#define OWN_INLINE 2         /* owners held in the block's own slots (most blocks have one) */

typedef struct {
    PyObject *sid;          /* the session (owned); NULL: a free slot */
    int32_t *blocks;        /* entries: a block and its generation when the session took it */
    uint32_t *gens;
    Py_ssize_t n, cap, live; /* live: entries not stale (the session's blocks) */
    int parked, pinned;     /* pinned: a drop in progress holds it */
    double rank;            /* park_rank of its expected return, while parked */
} Sess;

/* what a claim, a free or an eviction reads and writes of block b, in one cache line (an array
   per field was a cache miss per field at scale) */
typedef struct {
    int32_t ref;
    int32_t own_n;          /* how many owners the block has; -1: no entry (the reference's owners.get(b) is None) */
    int32_t own_cap;        /* OWN_INLINE: they are in own_in, else in own_v[b] */
    int32_t own_in[2];
    uint32_t gen;           /* moves on when the block is forgotten */
    int32_t prev, next;     /* LRU, oldest at head */
    PyObject *name;         /* NULL or bytes (owned) */
    int64_t freed_at;
    int64_t ep_tick;        /* ParkedFirst._evictable_parked (-1: absent) */
    uint8_t in_lru;
    uint8_t is_parked;      /* ParkedFirst._parked */
    uint8_t mark;           /* scratch */
} Blk;

typedef struct {
    PyObject_HEAD
    Py_ssize_t nb, blk_stride;
    Blk *blk;
    int32_t **own_v;        /* block b's owners when more than OWN_INLINE: OWN_ANON, OWN_SHARED or a session slot */
    Sess *sess;             /* session slots */
    Py_ssize_t sess_cap, sess_top, n_free_slots;
    int32_t *free_slots;
    PyObject *sess_index;   /* dict session -> its slot (int) */
    PyObject **ids;         /* NULL or block b's int object (owned), made on first use */
    PyObject **pairs;       /* NULL or the last (block, name) tuple made for block b (owned) */
    Slot *nidx;             /* the name index: open addressing over named blocks (b -1: free slot) */
    uint64_t *nhash;        /* block b's name hashed (name_hash), while it is named */
    Py_ssize_t nmask, nlen; /* index size - 1 (a power of two, at least twice nb: it never fills) */
    PyObject *parked;       /* dict session -> expected return (float or None) */
    int32_t *empty;         /* ring buffer */
    Py_ssize_t e_head, e_len;
    int64_t tick;
    int32_t lru_head, lru_tail;
    Py_ssize_t lru_len;
    double *rank;
    Py_ssize_t ep_len;
    int64_t ptick;
    Run **heap;
    Py_ssize_t heap_len, heap_cap, runs_size;
    PyObject *on_evict, *on_event, *hooks, *shared, *no_free;
    int max_owners, block_size;
    long long st_lookups, st_lookup_blocks, st_hit_blocks, st_evictions, st_commits, st_dup;
    /* the events of the call in progress, coalesced (see ev_stored): ev_kind 0 none, 1 one
       BlockStored of ev_names (parent ev_parent; ev_tokens NULL: without tokens), 2 one
       BlockRemoved of ev_names; handed to on_event when the call returns (ev_done) */
    int ev_kind;
    PyObject *ev_names, *ev_parent, *ev_tokens;
} Core;

/* ---- LRU ----------------------------------------------------------------------------------- */
static void lru_unlink(Core *c, int32_t b) {
    int32_t p = c->blk[b].prev, n = c->blk[b].next;
    if (p >= 0) c->blk[p].next = n; else c->lru_head = n;
    if (n >= 0) c->blk[n].prev = p; else c->lru_tail = p;
    c->blk[b].in_lru = 0;
    c->lru_len--;
}
static void lru_append(Core *c, int32_t b) {
    c->blk[b].prev = c->lru_tail;
    c->blk[b].next = -1;
    if (c->lru_tail >= 0) c->blk[c->lru_tail].next = b; else c->lru_head = b;
    c->lru_tail = b;
    c->blk[b].in_lru = 1;
    c->lru_len++;
}
static void lru_insert(Core *c, int32_t b) { if (c->blk[b].in_lru) lru_unlink(c, b); lru_append(c, b); }
static void lru_remove(Core *c, int32_t b) { if (c->blk[b].in_lru) lru_unlink(c, b); }
static int32_t lru_pop(Core *c) {
    int32_t b = c->lru_head;
    if (b >= 0) lru_unlink(c, b);
    return b;
}

/* ---- parked runs (a heap keyed by (neg, key)) ------------------------------------------------ */
static int run_less(const Run *a, const Run *b) { return a->neg < b->neg || (a->neg == b->neg && a->key < b->key); }
static void heap_down(Core *c, Py_ssize_t i) {
    Run **h = c->heap;
    for (;;) {
        Py_ssize_t l = 2 * i + 1, m = i;
        if (l < c->heap_len && run_less(h[l], h[m])) m = l;
        if (l + 1 < c->heap_len && run_less(h[l + 1], h[m])) m = l + 1;
        if (m == i) return;
        Run *t = h[i]; h[i] = h[m]; h[m] = t; i = m;
    }
}
static void free_run(Run *r) { free(r->blocks); free(r->ticks); free(r); }
static int heap_push(Core *c, Run *r) {
    if (c->heap_len == c->heap_cap) {
        Py_ssize_t cap = c->heap_cap ? 2 * c->heap_cap : 64;
        Run **h = realloc(c->heap, cap * sizeof(Run *));
        if (!h) { free_run(r); PyErr_NoMemory(); return -1; }
        c->heap = h; c->heap_cap = cap;
    }
    Py_ssize_t i = c->heap_len++;
    c->heap[i] = r;
    while (i > 0) {
        Py_ssize_t p = (i - 1) / 2;
        if (!run_less(c->heap[i], c->heap[p])) break;
        Run *t = c->heap[i]; c->heap[i] = c->heap[p]; c->heap[p] = t; i = p;
    }
    return 0;
}
static void heap_pop_top(Core *c) {
    free_run(c->heap[0]);
    c->heap[0] = c->heap[--c->heap_len];
    if (c->heap_len) heap_down(c, 0);
}
/* blocks parked with one rank at consecutive ticks from first_tick: one heap entry */
static int runs_push(Core *c, double rank, const int32_t *blocks, Py_ssize_t n, int64_t first_tick) {
    if (n == 0) return 0;
    Run *r = malloc(sizeof(Run));
    if (r) { r->blocks = malloc(n * sizeof(int32_t)); r->ticks = malloc(n * sizeof(int64_t)); }
    if (!r || !r->blocks || !r->ticks) {
        if (r) { free(r->blocks); free(r->ticks); free(r); }
        PyErr_NoMemory();
        return -1;
    }
    memcpy(r->blocks, blocks, n * sizeof(int32_t));
    for (Py_ssize_t k = 0; k < n; k++) r->ticks[k] = first_tick + k;
    r->neg = -rank; r->key = first_tick; r->n = n; r->i = 0;
    c->runs_size += n;
    return heap_push(c, r);
}
static int32_t runs_pop(Core *c) {
    while (c->heap_len) {
        Run *r = c->heap[0];
        Py_ssize_t start = r->i, i = r->i;
        while (i < r->n) {
            int32_t b = r->blocks[i];
            i++;
            if (c->blk[b].ep_tick == r->ticks[i - 1]) {
                r->i = i;
                c->runs_size -= i - start;
                if (i == r->n) heap_pop_top(c);
                return b;
            }
        }
        c->runs_size -= r->n - start;
        heap_pop_top(c);
    }
    return -1;
}
static int runs_compact(Core *c) {
    if (c->runs_size <= 2 * c->ep_len + 64) return 0;
    Py_ssize_t old = c->heap_len, kept = 0, size = 0;
    for (Py_ssize_t h = 0; h < old; h++) {
        Run *r = c->heap[h];
        Py_ssize_t w = 0;
        for (Py_ssize_t k = r->i; k < r->n; k++)
            if (c->blk[r->blocks[k]].ep_tick == r->ticks[k]) { r->blocks[w] = r->blocks[k]; r->ticks[w] = r->ticks[k]; w++; }
        if (w) { r->n = w; r->i = 0; r->key = r->ticks[0]; c->heap[kept++] = r; size += w; }
        else free_run(r);
    }
    c->heap_len = kept;
    c->runs_size = size;
    for (Py_ssize_t i = kept / 2 - 1; i >= 0; i--) heap_down(c, i);
    return 0;
}

/* ---- ParkedFirst(LRUPolicy()) ----------------------------------------------------------------- */
static Py_ssize_t pf_len(Core *c) { return c->ep_len + c->lru_len; }
static int pf_insert(Core *c, int32_t b) {
    if (c->blk[b].is_parked) {
        if (c->blk[b].ep_tick < 0) c->ep_len++;
        int64_t t = c->blk[b].ep_tick = c->ptick++;
        if (runs_push(c, c->rank[b], &b, 1, t) < 0) return -1;
        return runs_compact(c);
    }
    lru_insert(c, b);
    return 0;
}
static void pf_remove(Core *c, int32_t b) {
    if (c->blk[b].ep_tick >= 0) { c->blk[b].ep_tick = -1; c->ep_len--; }
    else lru_remove(c, b);
}
static int pf_set_parked(Core *c, int32_t b, double rank) {
    int evictable = c->blk[b].ep_tick >= 0 || c->blk[b].in_lru;
    pf_remove(c, b);
    c->blk[b].is_parked = 1; c->rank[b] = rank;
    return evictable ? pf_insert(c, b) : 0;
}
static void pf_unpark(Core *c, int32_t b) {
    if (c->blk[b].is_parked) {
        c->blk[b].is_parked = 0;
        if (c->blk[b].ep_tick >= 0) { c->blk[b].ep_tick = -1; c->ep_len--; lru_insert(c, b); }
    }
}
static int32_t pf_pop(Core *c) {
    int32_t b = runs_pop(c);
    if (b < 0) return lru_pop(c);
    c->blk[b].ep_tick = -1; c->ep_len--;
    c->blk[b].is_parked = 0;
    return b;
}
static void pf_touch(Core *c, int32_t b) { if (c->blk[b].ep_tick < 0 && c->blk[b].in_lru) { lru_unlink(c, b); lru_append(c, b); } }

/* blocks leave the parked class (those with a NAN rank when ranks is given); the evictable ones
   go to the LRU tail in this order */
static int pf_unpark_many(Core *c, const int32_t *blocks, const double *ranks, Py_ssize_t n) {
    int32_t *back = malloc((n ? n : 1) * sizeof(int32_t));
    if (!back) { PyErr_NoMemory(); return -1; }
    Py_ssize_t nback = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        int32_t b = blocks[k];
        if ((ranks && !isnan(ranks[k])) || !c->blk[b].is_parked) continue;
        c->blk[b].is_parked = 0;
        if (c->blk[b].ep_tick >= 0) { c->blk[b].ep_tick = -1; c->ep_len--; back[nback++] = b; }
    }
    for (Py_ssize_t k = 0; k < nback; k++) lru_insert(c, back[k]);
    free(back);
    return 0;
}
/* ranks: NAN where the reference passes None (unpark) */
static int pf_set_classes(Core *c, const int32_t *blocks, const double *ranks, Py_ssize_t n) {
    for (Py_ssize_t k = 0; k < n; k++) {
        int32_t b = blocks[k];
        if (!isnan(ranks[k]) && c->blk[b].ep_tick < 0 && c->blk[b].in_lru) { lru_unlink(c, b); c->blk[b].mark = 1; }
    }
    int32_t *run = malloc((n ? n : 1) * sizeof(int32_t));
    if (!run) { PyErr_NoMemory(); return -1; }
    Py_ssize_t nrun = 0;
    double run_rank = 0.0;
    int64_t run_tick = 0;
    int rc = 0;
    for (Py_ssize_t k = 0; k < n && rc == 0; k++) {
        int32_t b = blocks[k];
        double r = ranks[k];
        if (isnan(r)) continue;
        c->blk[b].is_parked = 1; c->rank[b] = r;
        if (c->blk[b].ep_tick >= 0 || c->blk[b].mark) {
            if (c->blk[b].ep_tick < 0) c->ep_len++;
            int64_t t = c->blk[b].ep_tick = c->ptick++;
            if (nrun && r != run_rank) { rc = runs_push(c, run_rank, run, nrun, run_tick); nrun = 0; }
            if (!nrun) { run_rank = r; run_tick = t; }
            run[nrun++] = b;
        }
    }
    for (Py_ssize_t k = 0; k < n; k++) c->blk[blocks[k]].mark = 0;
    if (rc == 0) rc = runs_push(c, run_rank, run, nrun, run_tick);
    free(run);
    if (rc == 0) rc = pf_unpark_many(c, blocks, ranks, n);
    if (rc == 0) rc = runs_compact(c);
    return rc;
}

/* ---- helpers ------------------------------------------------------------------------------- */
static int check_block(Core *c, Py_ssize_t b) {
    if (b < 0 || b >= c->nb) { PyErr_Format(PyExc_IndexError, "block id %zd out of range 0..%zd", b, c->nb - 1); return -1; }
    return 0;
}
/* block ids of a sequence into a malloc'd array; -1 with an error set */
static Py_ssize_t block_array(Core *c, PyObject *seq, int32_t **out) {
    PyObject *fast = PySequence_Fast(seq, "block ids must be a sequence");
    if (!fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    int32_t *a = malloc((n ? n : 1) * sizeof(int32_t));
    if (!a) { Py_DECREF(fast); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t b = PyLong_AsSsize_t(items[k]);
        if ((b == -1 && PyErr_Occurred()) || check_block(c, b) < 0) { free(a); Py_DECREF(fast); return -1; }
        a[k] = (int32_t)b;
    }
    Py_DECREF(fast);
    *out = a;
    return n;
}
/* a new reference to block b's int: one object per block, so lists of blocks allocate no ints.
   They are made ID_CHUNK at a time, so the ints of neighbouring blocks (a sequence's table is
   mostly consecutive ids) lie side by side instead of wherever the heap was when each was first
   asked for: a table's references then touch a few cache lines, not one per block */
#define ID_CHUNK 128
static PyObject *block_obj(Core *c, int32_t b) {
    PyObject *v = c->ids[b];
    if (!v) {
        Py_ssize_t lo = b - b % ID_CHUNK, hi = lo + ID_CHUNK < c->nb ? lo + ID_CHUNK : c->nb;
        for (Py_ssize_t i = lo; i < hi; i++)
            if (!c->ids[i] && !(c->ids[i] = PyLong_FromSsize_t(i))) return NULL;
        v = c->ids[b];
    }
    Py_INCREF(v);
    return v;
}
/* a new reference to a (block, name) tuple; name borrowed. The last one made for a block is kept
 * and handed out again while the block's name is the same object (park and unpark return a
 * session's blocks each time: most of a turn's tuples were these) */
static PyObject *block_pair(Core *c, int32_t b, PyObject *name) {
    PyObject *t = c->pairs[b];
    if (t && PyTuple_GET_ITEM(t, 1) == name) { Py_INCREF(t); return t; }
    t = PyTuple_New(2);
    PyObject *v = t ? block_obj(c, b) : NULL;
    if (!v) { Py_XDECREF(t); return NULL; }
    Py_INCREF(name);
    PyTuple_SET_ITEM(t, 0, v);
    PyTuple_SET_ITEM(t, 1, name);
    Py_INCREF(t);
    Py_XSETREF(c->pairs[b], t);
    return t;
}
static PyObject *int_list(Core *c, const int32_t *a, Py_ssize_t n) {
    PyObject *l = PyList_New(n);
    if (!l) return NULL;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *v = block_obj(c, a[k]);
        if (!v) { Py_DECREF(l); return NULL; }
        PyList_SET_ITEM(l, k, v);
    }
    return l;
}
static void empty_append(Core *c, int32_t b) { c->empty[(c->e_head + c->e_len++) % c->nb] = b; }
static int32_t empty_popleft(Core *c) { int32_t b = c->empty[c->e_head]; c->e_head = (c->e_head + 1) % c->nb; c->e_len--; return b; }

/* ---- the name index (the reference's by_name dict) ------------------------------------------------ */
static uint64_t name_hash(PyObject *name) {       /* name: bytes */
    return bytes_hash(PyBytes_AS_STRING(name), PyBytes_GET_SIZE(name));
}
/* the block named key (bytes, hashed h), or -1 */
static int32_t index_find(Core *c, PyObject *key, uint64_t h) {
    const char *p = PyBytes_AS_STRING(key);
    Py_ssize_t n = PyBytes_GET_SIZE(key);
    uint32_t lo = (uint32_t)h;
    for (Py_ssize_t i = (Py_ssize_t)(h & (uint64_t)c->nmask);; i = (i + 1) & c->nmask) {
        int32_t b = c->nidx[i].b;
        if (b < 0) return -1;
        if (c->nidx[i].lo != lo) continue;
        PyObject *nm = c->blk[b].name;
        if (nm == key || (c->nhash[b] == h && PyBytes_GET_SIZE(nm) == n && memcmp(PyBytes_AS_STRING(nm), p, (size_t)n) == 0))
            return b;
    }
}
/* a name asked for: -1 when it is not bytes (no block can hold it), else its block or -1 */
static int32_t index_get(Core *c, PyObject *key) {
    return PyBytes_Check(key) ? index_find(c, key, name_hash(key)) : -1;
}
static void index_insert(Core *c, int32_t b, uint64_t h) {
    Py_ssize_t i = (Py_ssize_t)(h & (uint64_t)c->nmask);
    while (c->nidx[i].b >= 0) i = (i + 1) & c->nmask;
    c->nidx[i] = (Slot){b, (uint32_t)h};
    c->nhash[b] = h;
    c->nlen++;
}
/* take block b out of the index (backward shift: later entries of its probe run move up, so no
   lookup needs a tombstone); 0 when it was not there */
static int index_remove(Core *c, int32_t b) {
    Py_ssize_t mask = c->nmask, i = (Py_ssize_t)(c->nhash[b] & (uint64_t)mask);
    for (; c->nidx[i].b != b; i = (i + 1) & mask) if (c->nidx[i].b < 0) return 0;
    for (Py_ssize_t j = i;;) {
        j = (j + 1) & mask;
        int32_t t = c->nidx[j].b;
        if (t < 0) break;
        Py_ssize_t home = (Py_ssize_t)(c->nidx[j].lo & (uint64_t)mask);
        if (shift_moves(i, j, home)) {
            c->nidx[i] = c->nidx[j];
            i = j;
        }
    }
    c->nidx[i] = (Slot){-1, 0};
    c->nlen--;
    return 1;
}

static double park_rank(PyObject *v, int *err) {
    if (v == Py_None) return INFINITY;
    double d = PyFloat_AsDouble(v);
    if (d == -1.0 && PyErr_Occurred()) *err = 1;
    return d;
}
static int hook(Core *c, const char *name, PyObject *args) {       /* steals args */
    if (!args) return -1;
    PyObject *f = PyObject_GetAttrString(c->hooks, name);
    if (!f) { Py_DECREF(args); return -1; }
    PyObject *r = PyObject_CallObject(f, args);
    Py_DECREF(f); Py_DECREF(args);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

/* ---- events -------------------------------------------------------------------------------- */
/* the pending event goes to on_event now */
static int ev_flush(Core *c) {
    int kind = c->ev_kind, rc = 0;
    if (!kind) return 0;
    PyObject *names = c->ev_names, *parent = c->ev_parent, *tokens = c->ev_tokens;
    c->ev_kind = 0;
    c->ev_names = c->ev_parent = c->ev_tokens = NULL;
    if (c->on_event != Py_None)
        rc = kind == 1
            ? hook(c, "emit_stored", Py_BuildValue("(OOiOO)", c->on_event, names, c->block_size, parent,
                                                   tokens ? tokens : Py_None))
            : hook(c, "emit_removed", Py_BuildValue("(OO)", c->on_event, names));
    Py_DECREF(names); Py_XDECREF(parent); Py_XDECREF(tokens);
    return rc;
}
/* a block named (tokens: its token ids, or NULL/None): it extends the pending BlockStored when
   its parent is that one's last name and both carry tokens or neither does (kv/events.coalesce) */
static int ev_stored(Core *c, PyObject *name, PyObject *parent, PyObject *tokens) {
    Py_ssize_t nt = 0;
    if (tokens && tokens != Py_None && (nt = PyObject_Length(tokens)) < 0) return -1;
    if (c->ev_kind == 1 && parent != Py_None && (c->ev_tokens != NULL) == (nt > 0)) {
        PyObject *last = PyList_GET_ITEM(c->ev_names, PyList_GET_SIZE(c->ev_names) - 1);
        int same = last == parent ? 1 : PyObject_RichCompareBool(last, parent, Py_EQ);
        if (same < 0) return -1;
        if (same) {
            if (PyList_Append(c->ev_names, name) < 0) return -1;
            if (!nt) return 0;
            Py_ssize_t at = PyList_GET_SIZE(c->ev_tokens);
            return PyList_SetSlice(c->ev_tokens, at, at, tokens);
        }
    }
    if (ev_flush(c) < 0) return -1;
    PyObject *names = PyList_New(1), *toks = nt ? PySequence_List(tokens) : NULL;
    if (!names || (nt && !toks)) { Py_XDECREF(names); Py_XDECREF(toks); return -1; }
    Py_INCREF(name);
    PyList_SET_ITEM(names, 0, name);
    Py_INCREF(parent);
    c->ev_kind = 1;
    c->ev_names = names; c->ev_parent = parent; c->ev_tokens = toks;
    return 0;
}
/* a block forgotten: consecutive removals are one BlockRemoved */
static int ev_removed(Core *c, PyObject *name) {
    if (c->ev_kind != 2) {
        if (ev_flush(c) < 0) return -1;
        if (!(c->ev_names = PyList_New(0))) return -1;
        c->ev_kind = 2;
    }
    return PyList_Append(c->ev_names, name);
}
/* a method that may name or forget blocks returns through here: its events go out, in order, as
   it returns (an error it raised stays the error) */
static PyObject *ev_done(Core *c, PyObject *r) {
    if (!c->ev_kind) return r;
    PyObject *t = NULL, *v = NULL, *tb = NULL;
    if (!r) PyErr_Fetch(&t, &v, &tb);
    int rc = ev_flush(c);
    if (!r) {
        if (rc < 0) PyErr_Clear();
        PyErr_Restore(t, v, tb);
        return NULL;
    }
    if (rc < 0) { Py_DECREF(r); return NULL; }
    return r;
}

/* ---- session slots ------------------------------------------------------------------------- */
/* the slot of a session; OWN_ANON for None, OWN_SHARED for SHARED; a new slot when create and it
   has none (else OWN_NONE); OWN_ERR with an error set */
#define OWN_NONE (-3)
#define OWN_ERR (-4)
static int32_t owner_slot(Core *c, PyObject *owner, int create) {
    if (owner == Py_None) return OWN_ANON;
    if (owner == c->shared) return OWN_SHARED;
    PyObject *v = PyDict_GetItemWithError(c->sess_index, owner);
    if (v) return (int32_t)PyLong_AsLong(v);
    if (PyErr_Occurred()) return OWN_ERR;
    if (!create) return OWN_NONE;
    int32_t i;
    if (c->n_free_slots) i = c->free_slots[--c->n_free_slots];
    else {
        if (c->sess_top == c->sess_cap) {
            Py_ssize_t cap = c->sess_cap ? 2 * c->sess_cap : 64;
            Sess *t = realloc(c->sess, cap * sizeof(Sess));
            int32_t *f = t ? realloc(c->free_slots, cap * sizeof(int32_t)) : NULL;
            if (t) c->sess = t;
            if (!f) { PyErr_NoMemory(); return OWN_ERR; }
            c->free_slots = f; c->sess_cap = cap;
        }
        i = (int32_t)c->sess_top++;
    }
    PyObject *key = PyLong_FromLong(i);
    if (!key || PyDict_SetItem(c->sess_index, owner, key) < 0) {
        Py_XDECREF(key);
        c->free_slots[c->n_free_slots++] = i;
        return OWN_ERR;
    }
    Py_DECREF(key);
    Py_INCREF(owner);
    c->sess[i] = (Sess){owner, NULL, NULL, 0, 0, 0, 0, 0, 0.0};
    return i;
}
/* unindex: take the session out of sess_index too (its key hashed before: deleting it does not
   fail, and any error already set is kept) */
static void slot_free(Core *c, int32_t i, int unindex) {
    Sess *s = &c->sess[i];
    PyObject *sid = s->sid;
    free(s->blocks); free(s->gens);
    *s = (Sess){NULL, NULL, NULL, 0, 0, 0, 0, 0, 0.0};
    c->free_slots[c->n_free_slots++] = i;
    if (unindex) {
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        if (PyDict_DelItem(c->sess_index, sid) < 0) PyErr_Clear();
        PyErr_Restore(t, v, tb);
    }
    Py_DECREF(sid);
}
/* a slot with no blocks that is not parked goes (the reference has no entry for such a session) */
static void slot_release(Core *c, int32_t i) {
    if (i >= 0 && c->sess[i].live == 0 && !c->sess[i].parked && !c->sess[i].pinned) slot_free(c, i, 1);
}
static int slot_add(Core *c, int32_t i, int32_t b) {
    Sess *s = &c->sess[i];
    if (s->n == s->cap) {
        if (s->n > 2 * s->live + 16) {             /* mostly stale: keep the live entries, in order */
            Py_ssize_t w = 0;
            for (Py_ssize_t k = 0; k < s->n; k++)
                if (s->gens[k] == c->blk[s->blocks[k]].gen) { s->blocks[w] = s->blocks[k]; s->gens[w] = s->gens[k]; w++; }
            s->n = w;
        } else {
            Py_ssize_t cap = s->cap ? 2 * s->cap : 16;
            int32_t *bl = realloc(s->blocks, cap * sizeof(int32_t));
            if (bl) s->blocks = bl;
            uint32_t *g = bl ? realloc(s->gens, cap * sizeof(uint32_t)) : NULL;
            if (!g) { PyErr_NoMemory(); return -1; }
            s->gens = g; s->cap = cap;
        }
    }
    s->blocks[s->n] = b; s->gens[s->n] = c->blk[b].gen; s->n++;
    s->live++;
    return 0;
}
static PyObject *slot_obj(Core *c, int32_t o) {      /* borrowed */
    return o == OWN_ANON ? Py_None : o == OWN_SHARED ? c->shared : c->sess[o].sid;
}

/* ---- sessions (kv/prefix_sessions) ------------------------------------------------------------ */
/* rank of a block: 1 with *rank set when every owner is a parked session, 0 when not */
static int32_t *owners_of(Core *c, int32_t b) { return c->blk[b].own_cap > OWN_INLINE ? c->own_v[b] : c->blk[b].own_in; }
static int block_rank(Core *c, int32_t b, double *rank) {
    int32_t n = c->blk[b].own_n, *v = owners_of(c, b);
    if (n <= 0) return 0;
    double best = INFINITY;
    for (int32_t k = 0; k < n; k++) {
        if (v[k] < 0 || !c->sess[v[k]].parked) return 0;     /* None and SHARED are never parked */
        if (c->sess[v[k]].rank < best) best = c->sess[v[k]].rank;
    }
    *rank = best;
    return 1;
}
static int reclass(Core *c, int32_t b) {
    double r;
    if (!block_rank(c, b, &r)) { pf_unpark(c, b); return 0; }
    return pf_set_parked(c, b, r);
}
/* the reference's _own with the owner's slot o (owner_slot): o among the users of block b */
static int own(Core *c, int32_t b, int32_t o) {
    int32_t n = c->blk[b].own_n, *v = owners_of(c, b);
    if (n < 0) n = c->blk[b].own_n = 0;
    for (int32_t k = 0; k < n; k++) if (v[k] == o || v[k] == OWN_SHARED) return 0;
    if (n >= c->max_owners) o = OWN_SHARED;
    if (n == c->blk[b].own_cap) {                 /* more than fit: to (a bigger) own_v[b] */
        int32_t cap = 2 * n;
        if (cap > c->max_owners + 1) cap = c->max_owners + 1;
        if (cap < n + 1) cap = n + 1;
        int32_t *t = realloc(n > OWN_INLINE ? v : NULL, cap * sizeof(int32_t));
        if (!t) { PyErr_NoMemory(); return -1; }
        if (n <= OWN_INLINE) memcpy(t, v, n * sizeof(int32_t));
        c->own_v[b] = v = t; c->blk[b].own_cap = cap;
    }
    if (o == OWN_SHARED && n) { v[n] = v[0]; v[0] = o; }   /* first: a widely shared block's scan stops at once */
    else v[n] = o;
    c->blk[b].own_n = n + 1;
    if (o >= 0) {
        if (slot_add(c, o, b) < 0) return -1;
        if (c->sess[o].parked) return reclass(c, b);
    }
    pf_unpark(c, b);
    return 0;
}
typedef struct { int64_t key; int32_t b; } Keyed;
#define KEYED_LESS(x, y) ((x).key < (y).key || ((x).key == (y).key && (x).b < (y).b))
/* a sort by (key, block) with the comparison inline (qsort's callback per comparison was most of
 * park and unpark): insertion when short, else a natural merge sort between a and tmp (n entries
 * each): a session's blocks come in runs of rising or falling free ticks (a table is freed tail
 * first), so it finds those runs (a falling one reversed) and merges neighbours. Returns the one
 * that holds the sorted entries. */
static Keyed *keyed_sort(Keyed *a, Keyed *tmp, Py_ssize_t n) {
    if (n <= 16) {
        for (Py_ssize_t i = 1; i < n; i++) {
            Keyed x = a[i];
            Py_ssize_t j = i;
            for (; j > 0 && KEYED_LESS(x, a[j - 1]); j--) a[j] = a[j - 1];
            a[j] = x;
        }
        return a;
    }
    Py_ssize_t *bounds = malloc((n + 1) * sizeof(Py_ssize_t)), nr = 0;
    if (bounds) {
        for (Py_ssize_t i = 0; i < n;) {
            bounds[nr++] = i;
            Py_ssize_t j = i + 1;
            if (j < n && KEYED_LESS(a[j], a[i])) {
                while (j + 1 < n && KEYED_LESS(a[j + 1], a[j])) j++;
                for (Py_ssize_t l = i, r = j; l < r; l++, r--) { Keyed t = a[l]; a[l] = a[r]; a[r] = t; }
                j++;
            } else {
                while (j < n && !KEYED_LESS(a[j], a[j - 1])) j++;
            }
            i = j;
        }
    }                                          /* else no memory for the runs: widths 1, 2, 4... */
    for (Py_ssize_t w = 1; bounds ? nr > 1 : w < n; w *= 2) {
        Py_ssize_t m = 0, groups = bounds ? nr : (n + w - 1) / w;
        for (Py_ssize_t r = 0; r < groups; r += 2) {
            Py_ssize_t lo = bounds ? bounds[r] : r * w;
            Py_ssize_t mid = r + 1 < groups ? (bounds ? bounds[r + 1] : (r + 1) * w) : n;
            Py_ssize_t hi = r + 2 < groups ? (bounds ? bounds[r + 2] : (r + 2) * w) : n;
            Py_ssize_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi) tmp[k++] = KEYED_LESS(a[j], a[i]) ? a[j++] : a[i++];
            while (i < mid) tmp[k++] = a[i++];
            while (j < hi) tmp[k++] = a[j++];
            if (bounds) bounds[m++] = lo;
        }
        if (bounds) nr = m;
        Keyed *t = a;
        a = tmp;
        tmp = t;
    }
    free(bounds);
    return a;
}
/* the blocks of session slot i (none when i < 0) ordered by (free tick, block id) */
static Py_ssize_t session_order(Core *c, int32_t i, int32_t **out) {
    Sess *s = i >= 0 ? &c->sess[i] : NULL;
    Py_ssize_t n = s ? s->live : 0, k = 0;
    Keyed *ks = malloc((n ? 2 * n : 1) * sizeof(Keyed));
    int32_t *a = malloc((n ? n : 1) * sizeof(int32_t));
    if (!ks || !a) { free(ks); free(a); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t e = 0; s && e < s->n; e++) {
        int32_t b = s->blocks[e];
        if (s->gens[e] == c->blk[b].gen && k < n) { ks[k].b = b; ks[k].key = c->blk[b].freed_at; k++; }
    }
    Keyed *sorted = keyed_sort(ks, ks + n, k);
    for (Py_ssize_t j = 0; j < k; j++) a[j] = sorted[j].b;
    free(ks);
    *out = a;
    return k;
}

/* ---- forgetting and evicting ------------------------------------------------------------------ */
/* a new reference to the name it had (or None) */
static PyObject *forget(Core *c, int32_t b) {
    PyObject *name = c->blk[b].name;
    c->blk[b].name = NULL;
    if (name && index_remove(c, b)) {
        if (c->on_event != Py_None && ev_removed(c, name) < 0) {
            Py_DECREF(name); return NULL;
        }
    }
    int32_t n = c->blk[b].own_n;
    c->blk[b].own_n = -1;
    c->blk[b].gen++;                        /* every session's entry for it is stale now */
    for (int32_t k = 0; k < n; k++) {
        int32_t o = owners_of(c, b)[k];
        if (o >= 0) { c->sess[o].live--; slot_release(c, o); }
    }
    pf_unpark(c, b);
    if (!name) Py_RETURN_NONE;
    return name;
}
/* on_evict, then forget: a new reference to the name */
static PyObject *evicted(Core *c, int32_t b, PyObject *name) {
    if (c->on_evict != Py_None) {
        PyObject *r = PyObject_CallFunction(c->on_evict, "iO", b, name);
        if (r) Py_DECREF(r);
        else if (PyErr_ExceptionMatches(PyExc_Exception)) {
            PyObject *t, *v, *tb;
            PyErr_Fetch(&t, &v, &tb);
            PyErr_NormalizeException(&t, &v, &tb);
            if (tb) PyException_SetTraceback(v, tb);
            int rc = hook(c, "log_evict_failure", Py_BuildValue("(iO)", b, v));
            Py_XDECREF(t); Py_XDECREF(v); Py_XDECREF(tb);
            if (rc < 0) return NULL;
        } else return NULL;
    }
    c->st_evictions++;
    return forget(c, b);
}
static PyObject *evict_one(Core *c, int32_t *out) {
    int32_t b = pf_pop(c);
    if (b < 0 || c->blk[b].ref != 0 || !c->blk[b].name) { PyErr_SetString(PyExc_AssertionError, "policy returned a block in use"); return NULL; }
    *out = b;
    PyObject *name = c->blk[b].name;
    Py_INCREF(name);
    PyObject *r = evicted(c, b, name);
    Py_DECREF(name);
    return r;
}
static int evictable(Core *c, const int32_t *blocks, Py_ssize_t n) {
    for (Py_ssize_t k = 0; k < n; k++) c->blk[blocks[k]].freed_at = ++c->tick;
    for (Py_ssize_t k = 0; k < n; k++) if (pf_insert(c, blocks[k]) < 0) return -1;
    return 0;
}

/* ---- methods ----------------------------------------------------------------------------------- */
/* limit: only the first `limit` names (all when negative) */
static Py_ssize_t lookup_into(Core *c, PyObject *names, Py_ssize_t limit, int32_t **out, Py_ssize_t *total) {
    PyObject *fast = PySequence_Fast(names, "names must be a sequence");
    if (!fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast), k = 0;
    if (limit >= 0 && limit < n) n = limit;
    PyObject **items = PySequence_Fast_ITEMS(fast);
    int32_t *a = malloc((n ? n : 1) * sizeof(int32_t));
    if (!a) { Py_DECREF(fast); PyErr_NoMemory(); return -1; }
    for (; k < n; k++) {
        /* a prompt's blocks are mostly consecutive ids (fresh blocks come sorted): when the block
           after the previous hit holds this very name object, that is its index entry too */
        int32_t next = k ? a[k - 1] + 1 : -1;
        if (next > 0 && next < c->nb && c->blk[next].name == items[k]) { a[k] = next; continue; }
        if ((a[k] = index_get(c, items[k])) < 0) break;
    }
    Py_DECREF(fast);
    *out = a;
    if (total) *total = n;
    return k;
}
static PyObject *Core_lookup(Core *c, PyObject *names) {
    int32_t *a;
    Py_ssize_t k = lookup_into(c, names, -1, &a, NULL);
    if (k < 0) return NULL;
    PyObject *l = int_list(c, a, k);
    free(a);
    return l;
}
/* the hits of acquire(), with owner among each one's users; idle ones (ref 0) out of the policy */
static Py_ssize_t claim(Core *c, PyObject *names, Py_ssize_t limit, PyObject *owner, int32_t **hits, int32_t **idle,
                        Py_ssize_t *nidle) {
    Py_ssize_t total, n = lookup_into(c, names, limit, hits, &total);
    if (n < 0) return -1;
    c->st_lookups++; c->st_lookup_blocks += total; c->st_hit_blocks += n;
    int32_t *h = *hits, *id = malloc((n ? n : 1) * sizeof(int32_t));
    int32_t o = id && n ? owner_slot(c, owner, 1) : OWN_ANON;
    if (!id || o == OWN_ERR) { free(h); free(id); if (!id) PyErr_NoMemory(); return -1; }
    Py_ssize_t ni = 0;
    for (Py_ssize_t k = 0; k < n; k++) if (c->blk[h[k]].ref == 0) id[ni++] = h[k];
    for (Py_ssize_t k = 0; k < ni; k++) pf_remove(c, id[k]);
    int rc = 0;
    Py_ssize_t cur = 0;                       /* a walk over the session's entries beside the hits */
    for (Py_ssize_t k = 0; k < n && rc == 0; k++) {
        int32_t b = h[k];                     /* most hits: a private block the owner holds already */
        if (c->blk[b].own_n == 1 && c->blk[b].own_cap == OWN_INLINE && c->blk[b].own_in[0] == o) continue;
        if (o >= 0) {
            /* a live entry (b, its generation) of the session means it is among b's owners: a
               session claims its context in the order it took it, so its entries, read in order,
               answer for the shared blocks without the scattered owner arrays */
            Sess *s = &c->sess[o];
            while (cur < s->n && s->gens[cur] != c->blk[s->blocks[cur]].gen) cur++;
            if (cur < s->n && s->blocks[cur] == b) { cur++; continue; }
        }
        rc = own(c, b, o);
    }
    slot_release(c, o);
    if (rc < 0) { free(h); free(id); return -1; }
    *idle = id; *nidle = ni;
    return n;
}
/* acquire() takes a reference on each hit; refresh() hands the idle hits back as just freed, tail
   first; limit (acquire): of the first `limit` names only, as if given names[:limit] */
static PyObject *claim_call(Core *c, PyObject *args, PyObject *kw, int refresh) {
    static char *kwl[] = {"names", "owner", "limit", NULL}, *kwl_refresh[] = {"names", "owner", NULL};
    PyObject *names, *owner = Py_None, *lim = Py_None;
    if (!(refresh ? PyArg_ParseTupleAndKeywords(args, kw, "O|O", kwl_refresh, &names, &owner)
                  : PyArg_ParseTupleAndKeywords(args, kw, "O|OO", kwl, &names, &owner, &lim))) return NULL;
    Py_ssize_t limit = -1;
    if (lim != Py_None) {
        if ((limit = PyLong_AsSsize_t(lim)) == -1 && PyErr_Occurred()) return NULL;
        if (limit < 0) limit = 0;
    }
    int32_t *h, *id;
    Py_ssize_t ni, n = claim(c, names, limit, owner, &h, &id, &ni);
    if (n < 0) return NULL;
    PyObject *l;
    if (refresh) {
        for (Py_ssize_t k = 0; k < ni / 2; k++) { int32_t t = id[k]; id[k] = id[ni - 1 - k]; id[ni - 1 - k] = t; }
        l = evictable(c, id, ni) < 0 ? NULL : PyLong_FromSsize_t(n);
    } else {
        for (Py_ssize_t k = 0; k < n; k++) c->blk[h[k]].ref++;
        l = int_list(c, h, n);
    }
    free(h); free(id);
    return l;
}
static PyObject *Core_count_hits(Core *c, PyObject *args) {
    PyObject *names;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "On", &names, &limit)) return NULL;
    int32_t *a;
    Py_ssize_t hits = lookup_into(c, names, limit < 0 ? 0 : limit, &a, NULL), idle = 0;
    if (hits < 0) return NULL;
    for (Py_ssize_t k = 0; k < hits; k++) idle += c->blk[a[k]].ref == 0;
    free(a);
    return Py_BuildValue("(nn)", hits, idle);
}
static PyObject *Core_acquire(Core *c, PyObject *args, PyObject *kw) { return claim_call(c, args, kw, 0); }
static PyObject *Core_refresh(Core *c, PyObject *args, PyObject *kw) { return claim_call(c, args, kw, 1); }
static PyObject *Core_share(Core *c, PyObject *ids) {
    int32_t *a;
    Py_ssize_t n = block_array(c, ids, &a);
    if (n < 0) return NULL;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (c->blk[a[k]].ref < 1) { PyErr_Format(PyExc_ValueError, "block %d is not in use", a[k]); free(a); return NULL; }
        c->blk[a[k]].ref++;
    }
    free(a);
    Py_RETURN_NONE;
}
static int cmp_i32(const void *x, const void *y) { int32_t a = *(const int32_t *)x, b = *(const int32_t *)y; return (a > b) - (a < b); }
static PyObject *Core_allocate_body(Core *c, PyObject *args, PyObject *kw) {
    static char *kwl[] = {"n", "ascending", NULL};
    Py_ssize_t n = 1;
    int ascending = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|np", kwl, &n, &ascending)) return NULL;
    Py_ssize_t free_n = c->e_len + pf_len(c);
    if (n > free_n) {
        PyObject *msg = PyUnicode_FromFormat("need %zd blocks, %zd free or evictable", n, free_n);
        if (msg) { PyErr_SetObject(c->no_free, msg); Py_DECREF(msg); }
        return NULL;
    }
    int32_t *a = malloc((n > 0 ? n : 1) * sizeof(int32_t));
    if (!a) return PyErr_NoMemory();
    Py_ssize_t k = 0;
    for (; k < n; k++) {
        int32_t b;
        if (c->e_len) b = empty_popleft(c);
        else {
            PyObject *name = evict_one(c, &b);
            if (!name) break;                  /* the blocks taken so far stay taken, as in the reference */
            Py_DECREF(name);
        }
        c->blk[b].ref = 1;
        a[k] = b;
    }
    if (k < n) { free(a); return NULL; }
    if (ascending) qsort(a, n, sizeof(int32_t), cmp_i32);
    PyObject *l = int_list(c, a, n);
    free(a);
    return l;
}
static PyObject *Core_allocate(Core *c, PyObject *args, PyObject *kw) {
    return ev_done(c, Core_allocate_body(c, args, kw));
}
static PyObject *Core_evict_body(Core *c, PyObject *args) {
    Py_ssize_t n = 1;
    if (!PyArg_ParseTuple(args, "|n", &n)) return NULL;
    PyObject *l = PyList_New(0);
    if (!l) return NULL;
    while (PyList_GET_SIZE(l) < n && pf_len(c)) {
        int32_t b;
        PyObject *name = evict_one(c, &b);
        if (!name) { Py_DECREF(l); return NULL; }
        PyObject *t = block_pair(c, b, name);
        Py_DECREF(name);
        if (!t || PyList_Append(l, t) < 0) { Py_XDECREF(t); Py_DECREF(l); return NULL; }
        Py_DECREF(t);
        empty_append(c, b);
    }
    return l;
}
static PyObject *Core_evict(Core *c, PyObject *args) {
    return ev_done(c, Core_evict_body(c, args));
}
static PyObject *Core_evict_blocks_body(Core *c, PyObject *ids) {
    int32_t *a;
    Py_ssize_t n = block_array(c, ids, &a);
    if (n < 0) return NULL;
    PyObject *l = PyList_New(0);
    for (Py_ssize_t k = 0; l && k < n; k++) {
        int32_t b = a[k];
        PyObject *name = c->blk[b].name;
        if (c->blk[b].ref != 0 || !name) continue;
        pf_remove(c, b);
        Py_INCREF(name);
        PyObject *got = evicted(c, b, name);
        Py_DECREF(name);
        PyObject *t = got ? block_pair(c, b, got) : NULL;
        Py_XDECREF(got);
        if (!t || PyList_Append(l, t) < 0) { Py_XDECREF(t); Py_CLEAR(l); break; }
        Py_DECREF(t);
        empty_append(c, b);
    }
    free(a);
    return l;
}
static PyObject *Core_evict_blocks(Core *c, PyObject *ids) {
    return ev_done(c, Core_evict_blocks_body(c, ids));
}
/* commit(): a new reference to the block now holding `name` */
static PyObject *commit_one(Core *c, Py_ssize_t b, PyObject *name, int32_t owner, PyObject *parent, PyObject *tokens) {
    if (check_block(c, b) < 0) return NULL;
    if (c->blk[b].ref < 1) return PyErr_Format(PyExc_ValueError, "block %zd is not in use", b);
    PyObject *cur = c->blk[b].name;
    if (cur) {
        int ne = PyObject_RichCompareBool(cur, name, Py_NE);
        if (ne < 0) return NULL;
        if (ne) {
            PyObject *hex = PyObject_CallMethod(cur, "hex", NULL);
            if (hex) { PyErr_Format(PyExc_ValueError, "block %zd is already named %U", b, hex); Py_DECREF(hex); }
            return NULL;
        }
        if (own(c, (int32_t)b, owner) < 0) return NULL;
        return block_obj(c, (int32_t)b);
    }
    if (!PyBytes_Check(name))
        return PyErr_Format(PyExc_TypeError, "a block name must be bytes, not %.100s", Py_TYPE(name)->tp_name);
    uint64_t h = name_hash(name);
    int32_t other = index_find(c, name, h);
    if (other >= 0) { c->st_dup++; return block_obj(c, other); }
    PyObject *key = block_obj(c, (int32_t)b);
    if (!key) return NULL;
    Py_INCREF(name);
    c->blk[b].name = name;
    index_insert(c, (int32_t)b, h);
    c->st_commits++;
    if (c->on_event != Py_None) {
        if (ev_stored(c, name, parent, tokens) < 0) {
            Py_DECREF(key); return NULL;
        }
    }
    if (own(c, (int32_t)b, owner) < 0) { Py_DECREF(key); return NULL; }
    return key;
}
static PyObject *Core_commit(Core *c, PyObject *args, PyObject *kw) {
    static char *kwl[] = {"block_id", "name", "owner", "parent", "token_ids", NULL};
    Py_ssize_t b;
    PyObject *name, *owner = Py_None, *parent = Py_None, *tokens = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "nO|OOO", kwl, &b, &name, &owner, &parent, &tokens)) return NULL;
    int32_t o = owner_slot(c, owner, 1);
    if (o == OWN_ERR) return NULL;
    PyObject *r = commit_one(c, b, name, o, parent, tokens);
    slot_release(c, o);
    return ev_done(c, r);
}
/* commit_run(): commit(table[i], names[i], owner, names[i-1], token_ids' block i) for i in
   [start, end); returns the i whose block kept its name (commit returned table[i]) */
static PyObject *commit_run_body(Core *c, PyObject *table, PyObject *names, Py_ssize_t start, Py_ssize_t end,
                                 PyObject *owner, PyObject *tokens) {
    PyObject *ft = PySequence_Fast(table, "block_ids must be a sequence");
    PyObject *fn = ft ? PySequence_Fast(names, "names must be a sequence") : NULL;
    PyObject *out = fn ? PyList_New(0) : NULL;
    if (!out) { Py_XDECREF(ft); Py_XDECREF(fn); return NULL; }
    int32_t o = OWN_ANON;
    if (start < 0 || end > PySequence_Fast_GET_SIZE(ft) || end > PySequence_Fast_GET_SIZE(fn)) {
        PyErr_SetString(PyExc_IndexError, "commit_run range outside block_ids or names");
        goto fail;
    }
    if (start < end && (o = owner_slot(c, owner, 1)) == OWN_ERR) goto fail;
    for (Py_ssize_t i = start; i < end; i++) {
        PyObject *bo = PySequence_Fast_GET_ITEM(ft, i), *tok = NULL;
        Py_ssize_t b = PyLong_AsSsize_t(bo);
        if (b == -1 && PyErr_Occurred()) goto fail;
        if (c->on_event != Py_None && tokens != Py_None) {
            tok = PySequence_GetSlice(tokens, i * c->block_size, (i + 1) * c->block_size);
            if (!tok) goto fail;
        }
        PyObject *parent = i ? PySequence_Fast_GET_ITEM(fn, i - 1) : Py_None;
        PyObject *r = commit_one(c, b, PySequence_Fast_GET_ITEM(fn, i), o, parent, tok);
        Py_XDECREF(tok);
        if (!r) goto fail;
        Py_ssize_t got = PyLong_AsSsize_t(r);
        Py_DECREF(r);
        if (got == b) {
            PyObject *io = PyLong_FromSsize_t(i);
            if (!io || PyList_Append(out, io) < 0) { Py_XDECREF(io); goto fail; }
            Py_DECREF(io);
        }
    }
    slot_release(c, o);
    Py_DECREF(ft); Py_DECREF(fn);
    return out;
fail:
    if (o != OWN_ERR) slot_release(c, o);
    Py_DECREF(ft); Py_DECREF(fn); Py_DECREF(out);
    return NULL;
}
static PyObject *commit_run(Core *c, PyObject *table, PyObject *names, Py_ssize_t start, Py_ssize_t end,
                            PyObject *owner, PyObject *tokens) {
    return ev_done(c, commit_run_body(c, table, names, start, end, owner, tokens));
}
static PyObject *Core_commit_run_kw(Core *c, PyObject *args, PyObject *kw) {
    static char *kwl[] = {"block_ids", "names", "start", "end", "owner", "token_ids", NULL};
    PyObject *table, *names, *owner = Py_None, *tokens = Py_None;
    Py_ssize_t start, end;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOnn|OO", kwl, &table, &names, &start, &end, &owner, &tokens))
        return NULL;
    return commit_run(c, table, names, start, end, owner, tokens);
}
/* METH_FASTCALL | METH_KEYWORDS: positional calls (every caller's) are read here, not parsed from a
   format (a tenth of a call); a call with keywords goes through the tuple-and-dict version */
static PyObject *Core_commit_run(Core *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if ((kwnames && PyTuple_GET_SIZE(kwnames)) || nargs < 4 || nargs > 6) {
        Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
        PyObject *t = PyTuple_New(nargs), *kw = nkw ? PyDict_New() : NULL, *r = NULL;
        if (t && (kw || !nkw)) {
            for (Py_ssize_t i = 0; i < nargs; i++) { Py_INCREF(args[i]); PyTuple_SET_ITEM(t, i, args[i]); }
            int ok = 1;
            for (Py_ssize_t i = 0; i < nkw && ok; i++)
                ok = PyDict_SetItem(kw, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) == 0;
            if (ok) r = Core_commit_run_kw(c, t, kw);
        }
        Py_XDECREF(t); Py_XDECREF(kw);
        return r;
    }
    Py_ssize_t start = PyNumber_AsSsize_t(args[2], PyExc_OverflowError), end;
    if (start == -1 && PyErr_Occurred()) return NULL;
    if ((end = PyNumber_AsSsize_t(args[3], PyExc_OverflowError)) == -1 && PyErr_Occurred()) return NULL;
    return commit_run(c, args[0], args[1], start, end, nargs > 4 ? args[4] : Py_None, nargs > 5 ? args[5] : Py_None);
}
static PyObject *Core_free(Core *c, PyObject *ids) {
    int32_t *a;
    Py_ssize_t n = block_array(c, ids, &a);
    if (n < 0) return NULL;
    int32_t *ev = malloc((n ? n : 1) * sizeof(int32_t));
    if (!ev) { free(a); return PyErr_NoMemory(); }
    Py_ssize_t ne = 0;
    int failed = 0;
    for (Py_ssize_t k = n - 1; k >= 0 && !failed; k--) {
        int32_t b = a[k];
        int32_t r = c->blk[b].ref;
        if (r < 1) { PyErr_Format(PyExc_ValueError, "block %d freed more often than taken", b); failed = 1; break; }
        c->blk[b].ref = r - 1;
        if (r == 1) {
            if (!c->blk[b].name) {
                PyObject *got = forget(c, b);
                if (!got) { failed = 1; break; }
                Py_DECREF(got);
                empty_append(c, b);
            } else ev[ne++] = b;
        }
    }
    PyObject *t = NULL, *v = NULL, *tb = NULL;
    if (failed) PyErr_Fetch(&t, &v, &tb);
    int rc = evictable(c, ev, ne);
    free(a); free(ev);
    if (failed) { PyErr_Restore(t, v, tb); return NULL; }
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}
static PyObject *Core_touch(Core *c, PyObject *ids) {
    int32_t *a;
    Py_ssize_t n = block_array(c, ids, &a);
    if (n < 0) return NULL;
    for (Py_ssize_t k = 0; k < n; k++) pf_touch(c, a[k]);
    free(a);
    Py_RETURN_NONE;
}
static PyObject *Core_clear(Core *c, PyObject *unused) {
    PyObject *hook_obj = c->on_event, *removed = PyList_New(0);
    if (!removed) return NULL;
    c->on_event = Py_None;               /* one AllBlocksCleared (or the removals) instead of n events */
    Py_INCREF(Py_None);
    Py_ssize_t n = 0;
    int32_t b;
    int failed = 0;
    while ((b = pf_pop(c)) >= 0) {
        PyObject *name = forget(c, b);
        if (!name || PyList_Append(removed, name) < 0) { Py_XDECREF(name); failed = 1; break; }
        Py_DECREF(name);
        empty_append(c, b);
        n++;
    }
    Py_DECREF(c->on_event);
    c->on_event = hook_obj;
    if (failed) { Py_DECREF(removed); return NULL; }
    if (hook_obj != Py_None && PyList_GET_SIZE(removed)) {
        int rc = c->nlen == 0
            ? hook(c, "emit_cleared", Py_BuildValue("(O)", hook_obj))
            : hook(c, "emit_removed", Py_BuildValue("(OO)", hook_obj, removed));
        if (rc < 0) { Py_DECREF(removed); return NULL; }
    }
    Py_DECREF(removed);
    return PyLong_FromSsize_t(n);
}
static PyObject *Core_park(Core *c, PyObject *args, PyObject *kw) {
    static char *kwl[] = {"session_id", "expected_return", NULL};
    PyObject *sid, *ret = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O", kwl, &sid, &ret)) return NULL;
    if (sid == Py_None || sid == c->shared) {
        PyObject *r = PyObject_Repr(sid);
        if (r) { PyErr_Format(PyExc_ValueError, "cannot park session id %U", r); Py_DECREF(r); }
        return NULL;
    }
    if (PyDict_SetItem(c->parked, sid, ret) < 0) return NULL;
    int err = 0;
    double rank = park_rank(ret, &err);
    int32_t o = err ? OWN_ERR : owner_slot(c, sid, 1);
    if (o == OWN_ERR) return NULL;
    c->sess[o].parked = 1;
    c->sess[o].rank = rank;
    int32_t *blocks;
    Py_ssize_t n = session_order(c, o, &blocks);
    if (n < 0) return NULL;
    double *ranks = malloc((n ? n : 1) * sizeof(double));
    if (!ranks) { free(blocks); return PyErr_NoMemory(); }
    for (Py_ssize_t k = 0; k < n; k++) {
        double r;
        /* a block with one owner has this session as it (its blocks are the ones it owns) */
        ranks[k] = c->blk[blocks[k]].own_n == 1 ? rank : block_rank(c, blocks[k], &r) ? r : NAN;
    }
    PyObject *out = pf_set_classes(c, blocks, ranks, n) < 0 ? NULL : int_list(c, blocks, n);
    free(blocks); free(ranks);
    return out;
}
static PyObject *Core_unpark(Core *c, PyObject *sid) {
    int k = PyDict_Contains(c->parked, sid);
    if (k <= 0) return k < 0 ? NULL : PyLong_FromLong(0);
    if (PyDict_DelItem(c->parked, sid) < 0) return NULL;
    int32_t o = owner_slot(c, sid, 0), *blocks;
    if (o == OWN_ERR) return NULL;
    if (o >= 0) c->sess[o].parked = 0;
    Py_ssize_t n = session_order(c, o, &blocks);
    if (n < 0) return NULL;
    PyObject *out = pf_unpark_many(c, blocks, NULL, n) < 0 ? NULL : PyLong_FromSsize_t(n);
    free(blocks);
    slot_release(c, o);
    return out;
}
static PyObject *Core_drop_body(Core *c, PyObject *args, PyObject *kw) {
    static char *kwl[] = {"session_id", "keep", NULL};
    PyObject *sid, *keep = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O", kwl, &sid, &keep)) return NULL;
    PyObject *gone = PyDict_GetItemWithError(c->parked, sid);
    if (gone && PyDict_DelItem(c->parked, sid) < 0) return NULL;
    if (PyErr_Occurred()) return NULL;
    int32_t o = owner_slot(c, sid, 0);
    if (o == OWN_ERR) return NULL;
    Py_ssize_t n = 0;
    int32_t *a = NULL;
    if (o >= 0) {
        /* the session leaves the index now, so a keep() that names it again gets a new slot; this
           one stays taken (pinned: no forget below frees it) until its blocks no longer name it */
        Sess *s = &c->sess[o];
        s->parked = 0;
        if (!(a = malloc((s->live ? s->live : 1) * sizeof(int32_t)))) return PyErr_NoMemory();
        for (Py_ssize_t e = 0; e < s->n; e++)
            if (s->gens[e] == c->blk[s->blocks[e]].gen && n < s->live) a[n++] = s->blocks[e];
        qsort(a, n, sizeof(int32_t), cmp_i32);
        if (PyDict_DelItem(c->sess_index, sid) < 0) { free(a); slot_release(c, o); return NULL; }
        s->pinned = 1;
    }
    PyObject *freed = PyList_New(0);
    for (Py_ssize_t k = 0; freed && k < n; k++) {
        int32_t b = a[k], no = c->blk[b].own_n, *v = owners_of(c, b);
        for (int32_t j = 0; j < no; j++)
            if (v[j] == o) { v[j] = v[no - 1]; c->blk[b].own_n = --no; c->sess[o].live--; break; }
        PyObject *name = c->blk[b].name;
        int drop = no <= 0 && c->blk[b].ref == 0 && name;
        if (drop && keep != Py_None) {
            PyObject *r = PyObject_CallOneArg(keep, name);
            int t = r ? PyObject_IsTrue(r) : -1;
            Py_XDECREF(r);
            if (t < 0) { Py_CLEAR(freed); break; }
            drop = !t;
        }
        if (drop) {
            pf_remove(c, b);
            PyObject *got = forget(c, b);
            if (!got || PyList_Append(freed, got) < 0) { Py_XDECREF(got); Py_CLEAR(freed); break; }
            Py_DECREF(got);
            empty_append(c, b);
        } else if (reclass(c, b) < 0) { Py_CLEAR(freed); break; }
    }
    if (o >= 0) {                         /* after an error some blocks may still name it: they drop it */
        for (Py_ssize_t k = 0; k < n; k++) {
            int32_t b = a[k], no = c->blk[b].own_n, *v = owners_of(c, b);
            for (int32_t j = 0; j < no; j++) if (v[j] == o) { v[j] = v[no - 1]; c->blk[b].own_n = --no; break; }
        }
        slot_free(c, o, 0);
    }
    free(a);
    return freed;
}
static PyObject *Core_drop(Core *c, PyObject *args, PyObject *kw) {
    return ev_done(c, Core_drop_body(c, args, kw));
}
typedef struct { double neg; int64_t tick; int32_t b; } ParkedEntry;
static int parked_cmp(const void *x, const void *y) {
    const ParkedEntry *a = x, *b = y;
    if (a->neg != b->neg) return a->neg < b->neg ? -1 : 1;
    return (a->tick > b->tick) - (a->tick < b->tick);       /* ticks are unique */
}
/* the live parked entries by (-rank, tick), then the LRU from its oldest */
static PyObject *Core_evictable_order(Core *c, PyObject *unused) {
    Py_ssize_t k = 0;
    ParkedEntry *es = malloc((c->ep_len ? c->ep_len : 1) * sizeof(ParkedEntry));
    if (!es) return PyErr_NoMemory();
    for (Py_ssize_t h = 0; h < c->heap_len; h++) {
        Run *r = c->heap[h];
        for (Py_ssize_t i = r->i; i < r->n && k < c->ep_len; i++)
            if (c->blk[r->blocks[i]].ep_tick == r->ticks[i]) es[k++] = (ParkedEntry){r->neg, r->ticks[i], r->blocks[i]};
    }
    qsort(es, k, sizeof(ParkedEntry), parked_cmp);
    int32_t *order = malloc((k + c->lru_len ? k + c->lru_len : 1) * sizeof(int32_t));
    if (!order) { free(es); return PyErr_NoMemory(); }
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < k; i++) order[n++] = es[i].b;
    for (int32_t b = c->lru_head; b >= 0; b = c->blk[b].next) order[n++] = b;
    PyObject *l = int_list(c, order, n);
    free(es); free(order);
    return l;
}
static PyObject *Core_ref_count(Core *c, PyObject *arg) {
    Py_ssize_t b = PyLong_AsSsize_t(arg);
    if ((b == -1 && PyErr_Occurred()) || check_block(c, b) < 0) return NULL;
    return PyLong_FromLong(c->blk[b].ref);
}
static PyObject *Core_count_unreferenced(Core *c, PyObject *ids) {
    int32_t *a;
    Py_ssize_t n = block_array(c, ids, &a), k = 0;
    if (n < 0) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) k += c->blk[a[i]].ref == 0;
    free(a);
    return PyLong_FromSsize_t(k);
}
static PyObject *Core_name_of(Core *c, PyObject *arg) {
    Py_ssize_t b = PyLong_AsSsize_t(arg);
    if ((b == -1 && PyErr_Occurred()) || check_block(c, b) < 0) return NULL;
    PyObject *n = c->blk[b].name ? c->blk[b].name : Py_None;
    Py_INCREF(n);
    return n;
}
static PyObject *Core_block_of(Core *c, PyObject *name) {
    int32_t b = index_get(c, name);
    if (b < 0) Py_RETURN_NONE;
    return block_obj(c, b);
}

/* ---- attributes -------------------------------------------------------------------------------- */
static PyObject *get_num_free(Core *c, void *u) { return PyLong_FromSsize_t(c->e_len + pf_len(c)); }
static PyObject *get_num_empty(Core *c, void *u) { return PyLong_FromSsize_t(c->e_len); }
static PyObject *get_num_used(Core *c, void *u) { return PyLong_FromSsize_t(c->nb - c->e_len - pf_len(c)); }
static PyObject *get_num_parked(Core *c, void *u) { return PyLong_FromSsize_t(c->ep_len); }
static PyObject *get_num_evictable(Core *c, void *u) { return PyLong_FromSsize_t(pf_len(c)); }
static PyObject *get_ref(Core *c, void *u) { return PyMemoryView_FromObject((PyObject *)c); }
static int Core_getbuffer(Core *c, Py_buffer *view, int flags) {
    if (flags & PyBUF_WRITABLE) { PyErr_SetString(PyExc_BufferError, "reference counts are read-only"); view->obj = NULL; return -1; }
    if (!(flags & PyBUF_STRIDES)) { PyErr_SetString(PyExc_BufferError, "reference counts are strided"); view->obj = NULL; return -1; }
    view->buf = &c->blk[0].ref; view->obj = (PyObject *)c; Py_INCREF(c);
    view->len = c->nb * (Py_ssize_t)sizeof(int32_t); view->readonly = 1; view->itemsize = sizeof(int32_t);
    view->format = (flags & PyBUF_FORMAT) ? "i" : NULL; view->ndim = 1;
    view->shape = &c->nb;
    view->strides = &c->blk_stride;
    view->suboffsets = NULL; view->internal = NULL;
    return 0;
}
static PyBufferProcs Core_buffer = {(getbufferproc)Core_getbuffer, NULL};
static PyObject *get_names(Core *c, void *u) {
    PyObject *l = PyList_New(c->nb);
    for (Py_ssize_t b = 0; l && b < c->nb; b++) {
        PyObject *n = c->blk[b].name ? c->blk[b].name : Py_None;
        Py_INCREF(n);
        PyList_SET_ITEM(l, b, n);
    }
    return l;
}
static PyObject *get_owners(Core *c, void *u) {
    PyObject *d = PyDict_New();
    for (Py_ssize_t b = 0; d && b < c->nb; b++) {
        if (c->blk[b].own_n < 0) continue;
        PyObject *k = PyLong_FromSsize_t(b), *set = PySet_New(NULL);
        for (int32_t j = 0; set && j < c->blk[b].own_n; j++)
            if (PySet_Add(set, slot_obj(c, owners_of(c, b)[j])) < 0) Py_CLEAR(set);
        if (!k || !set || PyDict_SetItem(d, k, set) < 0) Py_CLEAR(d);
        Py_XDECREF(k); Py_XDECREF(set);
    }
    return d;
}
static PyObject *get_session_blocks(Core *c, void *u) {
    PyObject *d = PyDict_New();
    for (Py_ssize_t i = 0; d && i < c->sess_top; i++) {
        Sess *s = &c->sess[i];
        if (!s->sid || s->live == 0) continue;
        PyObject *set = PySet_New(NULL);
        for (Py_ssize_t e = 0; set && e < s->n; e++) {
            if (s->gens[e] != c->blk[s->blocks[e]].gen) continue;
            PyObject *v = block_obj(c, s->blocks[e]);
            if (!v || PySet_Add(set, v) < 0) Py_CLEAR(set);
            Py_XDECREF(v);
        }
        if (!set || PyDict_SetItem(d, s->sid, set) < 0) Py_CLEAR(d);
        Py_XDECREF(set);
    }
    return d;
}
static PyObject *get_stats(Core *c, void *u) {
    return Py_BuildValue("{sLsLsLsLsLsL}", "lookups", c->st_lookups, "lookup_blocks", c->st_lookup_blocks,
                         "hit_blocks", c->st_hit_blocks, "evictions", c->st_evictions, "commits", c->st_commits,
                         "duplicate_commits", c->st_dup);
}
static PyObject *get_obj(Core *c, void *which) {
    PyObject *o = which == (void *)0 ? c->on_evict : which == (void *)1 ? c->on_event : c->parked;
    Py_INCREF(o);
    return o;
}
static int set_hook(Core *c, PyObject *v, void *which) {
    if (!v) { PyErr_SetString(PyExc_AttributeError, "cannot delete a hook; set it to None"); return -1; }
    if (v != Py_None && !PyCallable_Check(v)) { PyErr_SetString(PyExc_TypeError, "a hook must be callable or None"); return -1; }
    PyObject **slot = which == (void *)0 ? &c->on_evict : &c->on_event;
    Py_INCREF(v);
    Py_SETREF(*slot, v);
    return 0;
}
static PyObject *get_int(Core *c, void *which) {
    return PyLong_FromSsize_t(which == (void *)0 ? c->nb : which == (void *)1 ? c->max_owners : c->block_size);
}
static PyGetSetDef Core_getset[] = {
    {"num_free_blocks", (getter)get_num_free, NULL, "blocks an allocation can get now", NULL},
    {"num_empty_blocks", (getter)get_num_empty, NULL, NULL, NULL},
    {"num_used_blocks", (getter)get_num_used, NULL, NULL, NULL},
    {"num_parked", (getter)get_num_parked, NULL, "evictable blocks of parked sessions", NULL},
    {"num_evictable", (getter)get_num_evictable, NULL, NULL, NULL},
    {"ref", (getter)get_ref, NULL, "reference counts (a read-only view)", NULL},
    {"names", (getter)get_names, NULL, "each block's name or None (a copy)", NULL},
    {"owners", (getter)get_owners, NULL, "named block -> its users (a copy of the mapping)", NULL},
    {"stats", (getter)get_stats, NULL, NULL, NULL},
    {"on_evict", (getter)get_obj, (setter)set_hook, NULL, (void *)0},
    {"on_event", (getter)get_obj, (setter)set_hook, NULL, (void *)1},
    {"session_blocks", (getter)get_session_blocks, NULL, "session -> its blocks (a copy)", NULL},
    {"parked", (getter)get_obj, NULL, NULL, (void *)3},
    {"num_blocks", (getter)get_int, NULL, NULL, (void *)0},
    {"max_owners", (getter)get_int, NULL, NULL, (void *)1},
    {"block_size", (getter)get_int, NULL, NULL, (void *)2},
    {NULL}
};
static PyMethodDef Core_methods[] = {
    {"lookup", (PyCFunction)Core_lookup, METH_O, NULL},
    {"acquire", (PyCFunction)(void (*)(void))Core_acquire, METH_VARARGS | METH_KEYWORDS, NULL},
    {"refresh", (PyCFunction)(void (*)(void))Core_refresh, METH_VARARGS | METH_KEYWORDS, NULL},
    {"count_hits", (PyCFunction)Core_count_hits, METH_VARARGS, NULL},
    {"share", (PyCFunction)Core_share, METH_O, NULL},
    {"allocate", (PyCFunction)(void (*)(void))Core_allocate, METH_VARARGS | METH_KEYWORDS, NULL},
    {"evict", (PyCFunction)Core_evict, METH_VARARGS, NULL},
    {"evict_blocks", (PyCFunction)Core_evict_blocks, METH_O, NULL},
    {"commit", (PyCFunction)(void (*)(void))Core_commit, METH_VARARGS | METH_KEYWORDS, NULL},
    {"commit_run", (PyCFunction)(void (*)(void))Core_commit_run, METH_FASTCALL | METH_KEYWORDS, NULL},
    {"free", (PyCFunction)Core_free, METH_O, NULL},
    {"touch", (PyCFunction)Core_touch, METH_O, NULL},
    {"clear", (PyCFunction)Core_clear, METH_NOARGS, NULL},
    {"park", (PyCFunction)(void (*)(void))Core_park, METH_VARARGS | METH_KEYWORDS, NULL},
    {"unpark", (PyCFunction)Core_unpark, METH_O, NULL},
    {"drop", (PyCFunction)(void (*)(void))Core_drop, METH_VARARGS | METH_KEYWORDS, NULL},
    {"evictable_order", (PyCFunction)Core_evictable_order, METH_NOARGS, NULL},
    {"ref_count", (PyCFunction)Core_ref_count, METH_O, NULL},
    {"count_unreferenced", (PyCFunction)Core_count_unreferenced, METH_O, NULL},
    {"name_of", (PyCFunction)Core_name_of, METH_O, NULL},
    {"block_of", (PyCFunction)Core_block_of, METH_O, NULL},
    {NULL}
};

/* ---- life -------------------------------------------------------------------------------------- */
static int Core_init(Core *c, PyObject *args, PyObject *kw) {
    static char *kwl[] = {"num_blocks", "hooks", "max_owners", "block_size", NULL};
    Py_ssize_t nb;
    PyObject *hooks;
    int max_owners = 32, block_size = 16;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "nO|ii", kwl, &nb, &hooks, &max_owners, &block_size)) return -1;
    if (c->nb) { PyErr_SetString(PyExc_RuntimeError, "already initialized"); return -1; }
    if (nb < 1 || nb > INT32_MAX) { PyErr_Format(PyExc_ValueError, "need num_blocks >= 1, got %zd", nb); return -1; }
    c->shared = PyObject_GetAttrString(hooks, "SHARED");
    c->no_free = PyObject_GetAttrString(hooks, "NoFreeBlocks");
    if (!c->shared || !c->no_free) return -1;
    c->blk = calloc(nb, sizeof(Blk)); c->blk_stride = sizeof(Blk);
    c->own_v = calloc(nb, sizeof(int32_t *));
    c->ids = calloc(nb, sizeof(PyObject *));
    c->pairs = calloc(nb, sizeof(PyObject *)); c->empty = malloc(nb * sizeof(int32_t));
    c->rank = calloc(nb, sizeof(double));
    Py_ssize_t size = 8;
    while (size < 2 * nb) size *= 2;
    c->nidx = malloc(size * sizeof(Slot)); c->nhash = malloc(nb * sizeof(uint64_t));
    c->sess_index = PyDict_New(); c->parked = PyDict_New();
    if (!c->nidx || !c->nhash || !c->blk || !c->own_v || !c->ids || !c->pairs || !c->empty || !c->rank) {
        PyErr_NoMemory(); return -1;
    }
    if (!c->sess_index || !c->parked) return -1;
    for (Py_ssize_t i = 0; i < size; i++) c->nidx[i] = (Slot){-1, 0};
    c->nmask = size - 1; c->nlen = 0;
    c->nb = nb;
    for (Py_ssize_t b = 0; b < nb; b++) { c->empty[b] = (int32_t)b; c->blk[b].ep_tick = -1; c->blk[b].own_n = -1; c->blk[b].own_cap = OWN_INLINE; }
    c->e_head = 0; c->e_len = nb;
    c->lru_head = c->lru_tail = -1;
    Py_INCREF(hooks); c->hooks = hooks;
    Py_INCREF(Py_None); c->on_evict = Py_None;
    Py_INCREF(Py_None); c->on_event = Py_None;
    c->max_owners = max_owners; c->block_size = block_size;
    return 0;
}
static int Core_traverse(Core *c, visitproc visit, void *arg) {
    Py_VISIT(c->sess_index); Py_VISIT(c->parked);
    Py_VISIT(c->on_evict); Py_VISIT(c->on_event); Py_VISIT(c->hooks);
    for (Py_ssize_t i = 0; i < c->sess_top; i++) Py_VISIT(c->sess[i].sid);
    return 0;
}
static int Core_clear_refs(Core *c) {
    Py_CLEAR(c->sess_index); Py_CLEAR(c->parked);
    Py_CLEAR(c->on_evict); Py_CLEAR(c->on_event); Py_CLEAR(c->hooks);
    for (Py_ssize_t i = 0; i < c->sess_top; i++) Py_CLEAR(c->sess[i].sid);
    return 0;
}
static void Core_dealloc(Core *c) {
    PyObject_GC_UnTrack(c);
    Core_clear_refs(c);
    if (c->blk) for (Py_ssize_t b = 0; b < c->nb; b++) Py_XDECREF(c->blk[b].name);
    if (c->ids) for (Py_ssize_t b = 0; b < c->nb; b++) Py_XDECREF(c->ids[b]);
    if (c->pairs) for (Py_ssize_t b = 0; b < c->nb; b++) Py_XDECREF(c->pairs[b]);
    Py_XDECREF(c->shared); Py_XDECREF(c->no_free);
    Py_XDECREF(c->ev_names); Py_XDECREF(c->ev_parent); Py_XDECREF(c->ev_tokens);
    for (Py_ssize_t h = 0; h < c->heap_len; h++) free_run(c->heap[h]);
    for (Py_ssize_t i = 0; i < c->sess_top; i++) { Py_XDECREF(c->sess[i].sid); free(c->sess[i].blocks); free(c->sess[i].gens); }
    if (c->own_v) for (Py_ssize_t b = 0; b < c->nb; b++) free(c->own_v[b]);
    free(c->sess); free(c->free_slots); free(c->blk); free(c->own_v);
    free(c->nidx); free(c->nhash);
    free(c->heap); free(c->ids); free(c->pairs); free(c->empty); free(c->rank);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "prefix_core.PrefixCore",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The G1 prefix cache with ParkedFirst(LRU) eviction, in C (see kv/prefix_core.py).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_traverse = (traverseproc)Core_traverse,
    .tp_clear = (inquiry)Core_clear_refs,
    .tp_methods = Core_methods,
    .tp_getset = Core_getset,
    .tp_as_buffer = &Core_buffer,
};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "prefix_core", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_prefix_core(void) {
    if (PyType_Ready(&CoreType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "PrefixCore", (PyObject *)&CoreType) < 0) { Py_DECREF(&CoreType); Py_DECREF(m); return NULL; }
    return m;
}
