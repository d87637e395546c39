/* hpkv._ringcall: the single-descriptor ring calls (push, try_push, pop, try_pop)
 * as methods of a CPython base type, so a round trip costs a few hundred ns of
 * Python instead of ≈ 1.5 µs through cffi (argument tuples, per-argument
 * conversion, a GIL release per call, and a namedtuple built in Python).
 *
 * This file holds no ring logic: it calls the native core's functions through
 * the table hpkv_ring_call_table() hands out (native/ring.c, compiled once, into
 * hpkv._native), so the rings have one implementation. Errors are raised by the
 * Python subclass (hpkv.ring.Ring): this type calls its methods
 * _wait_failed(rc, timeout, what), _handle() (raises once closed) and
 * _misuse(verb) (wrong end) on the slow paths only.
 *
 * The GIL is released only around a blocking wait; the first, non-blocking try
 * runs with it held (it is a few dozen ns and never sleeps).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>

#include "ring.h"

static const struct hpkv_ring_calls *calls; /* set by bind() */
static PyTypeObject *desc_type;             /* hpkv.ring.desc.Desc, a 10-field tuple subclass */
static PyObject *str_wait_failed, *str_handle, *str_misuse;
/* push's keywords (interned): kind, seq, a0..a5 (the positional fields), status, flags, timeout. */
enum { KW_KIND, KW_SEQ, KW_A5 = 7, KW_STATUS, KW_FLAGS, KW_TIMEOUT, KW_COUNT };
static PyObject *kw_names[KW_COUNT];

typedef struct {
    PyObject_HEAD hpkv_ring *ring; /* NULL: not attached yet, or closed */
    int role;
} RingCall;

/* ------------------------------------------------------------------ helpers */

static int not_bound(void)
{
    if (calls)
        return 0;
    PyErr_SetString(PyExc_RuntimeError,
                    "hpkv._ringcall.bind() was not called (import hpkv.ring first)");
    return 1;
}

/* The handle, or NULL with the subclass's RingClosed raised. */
static hpkv_ring *ring_of(RingCall *self)
{
    if (self->ring)
        return self->ring;
    PyObject *r = PyObject_CallMethodNoArgs((PyObject *)self, str_handle);
    Py_XDECREF(r);
    if (!PyErr_Occurred())
        PyErr_SetString(PyExc_RuntimeError, "ring handle is not attached");
    return NULL;
}

static PyObject *misuse(RingCall *self, const char *verb)
{
    PyObject *v = PyUnicode_FromString(verb);
    if (!v)
        return NULL;
    PyObject *r = PyObject_CallMethodOneArg((PyObject *)self, str_misuse, v);
    Py_DECREF(v);
    Py_XDECREF(r);
    if (!PyErr_Occurred())
        PyErr_SetString(PyExc_RuntimeError, "wrong ring end");
    return NULL;
}

/* A failed wait: -EINTR runs the signal handlers (0: retry), anything else is
 * turned into the subclass's exception. Returns -1 with an exception set. */
static int wait_failed(RingCall *self, int rc, PyObject *timeout, const char *what)
{
    if (rc == -EINTR)
        return PyErr_CheckSignals();
    PyObject *code = PyLong_FromLong(rc), *text = PyUnicode_FromString(what), *r = NULL;
    if (code && text)
        r = PyObject_CallMethodObjArgs((PyObject *)self, str_wait_failed, code, timeout, text,
                                       NULL);
    Py_XDECREF(code);
    Py_XDECREF(text);
    if (r) { /* _wait_failed returns only for a signal, which we handled above */
        Py_DECREF(r);
        PyErr_Format(PyExc_RuntimeError, "ring wait failed with code %d", rc);
    }
    return -1;
}

static int to_timeout(PyObject *obj, double *out)
{
    if (obj == NULL || obj == Py_None) {
        *out = INFINITY;
        return 0;
    }
    double t = PyFloat_AsDouble(obj);
    if (t == -1.0 && PyErr_Occurred())
        return -1;
    if (isnan(t)) {
        PyErr_SetString(PyExc_ValueError, "timeout must be a number of seconds or None, not nan");
        return -1;
    }
    *out = t;
    return 0;
}

/* An int (or an object with __index__, e.g. a numpy integer) as a new reference; bool is an int too. */
static PyObject *as_int(PyObject *obj, const char *name)
{
    if (PyLong_Check(obj))
        return Py_NewRef(obj);
    PyObject *v = PyNumber_Index(obj);
    if (!v) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "descriptor field %s must be an int, not %.100s", name,
                     Py_TYPE(obj)->tp_name);
    }
    return v;
}

static int to_u64(PyObject *obj, uint64_t *out, const char *name)
{
    PyObject *v = as_int(obj, name);
    if (!v)
        return -1;
    unsigned long long x = PyLong_AsUnsignedLongLong(v);
    Py_DECREF(v);
    if (x == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_OverflowError, "descriptor field %s must be in [0, 2**64), not %R", name,
                     obj);
        return -1;
    }
    *out = x;
    return 0;
}

static int to_small(PyObject *obj, long lo, long hi, long *out, const char *name)
{
    PyObject *v = as_int(obj, name);
    if (!v)
        return -1;
    int overflow = 0;
    long x = PyLong_AsLongAndOverflow(v, &overflow);
    Py_DECREF(v);
    if (overflow || x < lo || x > hi) {
        PyErr_Format(PyExc_OverflowError, "descriptor field %s must be in [%ld, %ld], not %R", name,
                     lo, hi, obj);
        return -1;
    }
    *out = x;
    return 0;
}

static const char *const arg_names[] = {"a0", "a1", "a2", "a3", "a4", "a5"};

/* push(kind, seq, a0=0, ..., a5=0, *, status=0, flags=0[, timeout=None]) -> descriptor. */
static int parse_push(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, int with_timeout,
                      hpkv_desc *d, PyObject **timeout)
{
    PyObject *field[2 + 6] = {NULL};
    PyObject *status = NULL, *flags = NULL;
    const char *fname = with_timeout ? "push" : "try_push";
    if (nargs > 8) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most 8 positional arguments (%zd given)",
                     fname, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++)
        field[i] = args[i];
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k), *value = args[nargs + k];
        int which = -1;
        for (int j = 0; j < KW_COUNT && which < 0; j++)
            if (name == kw_names[j])
                which = j;
        for (int j = 0; j < KW_COUNT && which < 0; j++)
            if (PyUnicode_Compare(name, kw_names[j]) == 0)
                which = j;
        if (which == KW_TIMEOUT && !with_timeout)
            which = -1;
        PyObject **slot = which < 0            ? NULL
                          : which <= KW_A5     ? &field[which]
                          : which == KW_STATUS ? &status
                          : which == KW_FLAGS  ? &flags
                                               : timeout;
        if (!slot) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument %R", fname,
                         name);
            return -1;
        }
        if (*slot) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument %R", fname, name);
            return -1;
        }
        *slot = value;
    }
    if (!field[0] || !field[1]) {
        PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fname,
                     field[0] ? "seq" : "kind");
        return -1;
    }
    long kind, fl = 0, st = 0;
    if (to_small(field[0], 0, 65535, &kind, "kind") || to_u64(field[1], &d->seq, "seq"))
        return -1;
    if (flags && to_small(flags, 0, 65535, &fl, "flags"))
        return -1;
    if (status && to_small(status, INT32_MIN, INT32_MAX, &st, "status"))
        return -1;
    for (int i = 0; i < 6; i++) {
        d->arg[i] = 0;
        if (field[2 + i] && to_u64(field[2 + i], &d->arg[i], arg_names[i]))
            return -1;
    }
    d->kind = (uint16_t)kind;
    d->flags = (uint16_t)fl;
    d->status = (int32_t)st;
    return 0;
}

static PyObject *build_desc(const hpkv_desc *d)
{
    /* tp_alloc of a tuple subclass, then the items: what tuple.__new__(Desc, ...) does, without the
     * intermediate tuple. The object is not visible to anyone before every item is set. */
    PyObject *t = desc_type->tp_alloc(desc_type, 10);
    if (!t)
        return NULL;
#if PY_VERSION_HEX >= 0x030E0000
    ((PyTupleObject *)t)->ob_hash =
        -1; /* 3.14 caches a tuple's hash: "not computed", as tuple_subtype_new */
#endif
    PyObject *items[10] = {
        PyLong_FromLong(d->kind),
        PyLong_FromLong(d->flags),
        PyLong_FromLong(d->status),
        PyLong_FromUnsignedLongLong(d->seq),
    };
    for (int i = 0; i < 6; i++)
        items[4 + i] = PyLong_FromUnsignedLongLong(d->arg[i]);
    for (int i = 0; i < 10; i++) {
        if (!items[i]) {
            for (int j = 0; j < 10; j++)
                Py_XDECREF(items[j]);
            Py_DECREF(t);
            return NULL;
        }
    }
    for (int i = 0; i < 10; i++)
        PyTuple_SET_ITEM(t, i, items[i]);
    return t;
}

/* ------------------------------------------------------------------ methods */

/* Arguments are converted before the handle is fetched: a conversion can run Python code (an
 * __index__, a signal handler) that closes the ring. */
static PyObject *RingCall_try_push(RingCall *self, PyObject *const *args, Py_ssize_t nargs,
                                   PyObject *kwnames)
{
    if (not_bound())
        return NULL;
    hpkv_desc d;
    if (parse_push(args, nargs, kwnames, 0, &d, NULL))
        return NULL;
    hpkv_ring *r = ring_of(self);
    if (!r)
        return NULL;
    if (self->role != HPKV_RING_PRODUCER)
        return misuse(self, "push to");
    return PyBool_FromLong(calls->try_push(r, &d, 1));
}

static PyObject *RingCall_push(RingCall *self, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames)
{
    if (not_bound())
        return NULL;
    hpkv_desc d;
    PyObject *timeout_obj = NULL;
    double timeout;
    if (parse_push(args, nargs, kwnames, 1, &d, &timeout_obj) || to_timeout(timeout_obj, &timeout))
        return NULL;
    hpkv_ring *r = ring_of(self);
    if (!r)
        return NULL;
    if (self->role != HPKV_RING_PRODUCER)
        return misuse(self, "push to");
    if (calls->try_push(r, &d, 1))
        Py_RETURN_NONE;
    for (;;) {
        int64_t done;
        Py_BEGIN_ALLOW_THREADS done = calls->push_wait(r, &d, 1, timeout);
        Py_END_ALLOW_THREADS if (done == 1) Py_RETURN_NONE;
        if (wait_failed(self, calls->last_error(r), timeout_obj ? timeout_obj : Py_None,
                        "room for a descriptor"))
            return NULL;
        timeout = NAN; /* after a signal: the same deadline */
        if (!(r = ring_of(self)))
            return NULL; /* a signal handler may have closed the ring */
    }
}

static PyObject *RingCall_try_pop(RingCall *self, PyObject *Py_UNUSED(ignored))
{
    if (not_bound())
        return NULL;
    hpkv_ring *r = ring_of(self);
    if (!r)
        return NULL;
    if (self->role != HPKV_RING_CONSUMER)
        return misuse(self, "pop from");
    hpkv_desc d;
    if (!calls->try_pop(r, &d, 1))
        Py_RETURN_NONE;
    return build_desc(&d);
}

static PyObject *RingCall_pop(RingCall *self, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames)
{
    if (not_bound())
        return NULL;
    PyObject *timeout_obj = nargs > 0 ? args[0] : NULL;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs + nkw > 1 ||
        (nkw == 1 && PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, 0), kw_names[KW_TIMEOUT]))) {
        PyErr_SetString(PyExc_TypeError, "pop() takes one argument, timeout (seconds or None)");
        return NULL;
    }
    if (nkw == 1)
        timeout_obj = args[0];
    double timeout;
    if (to_timeout(timeout_obj, &timeout))
        return NULL;
    hpkv_ring *r = ring_of(self);
    if (!r)
        return NULL;
    if (self->role != HPKV_RING_CONSUMER)
        return misuse(self, "pop from");
    hpkv_desc d;
    if (calls->try_pop(r, &d, 1))
        return build_desc(&d);
    for (;;) {
        int64_t got;
        Py_BEGIN_ALLOW_THREADS got = calls->pop_wait(r, &d, 1, timeout);
        Py_END_ALLOW_THREADS if (got > 0) return build_desc(&d);
        if (wait_failed(self, (int)got, timeout_obj ? timeout_obj : Py_None, "a descriptor"))
            return NULL;
        timeout = NAN;
        if (!(r = ring_of(self)))
            return NULL;
    }
}

/* _set_handle(address: int, role: int): attach the native handle (0 detaches it). */
static PyObject *RingCall_set_handle(RingCall *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "_set_handle(address, role)");
        return NULL;
    }
    void *p = PyLong_AsVoidPtr(args[0]);
    if (!p && PyErr_Occurred())
        return NULL;
    long role = PyLong_AsLong(args[1]);
    if (role == -1 && PyErr_Occurred())
        return NULL;
    self->ring = p;
    self->role = (int)role;
    Py_RETURN_NONE;
}

static PyMethodDef RingCall_methods[] = {
    {"push", (PyCFunction)(void (*)(void))RingCall_push, METH_FASTCALL | METH_KEYWORDS,
     "push(kind, seq, a0=0, ..., a5=0, *, status=0, flags=0, timeout=None)\n--\n\n"
     "Pushes one descriptor, waiting for room up to timeout s (None: no limit).\n"
     "Raises RingTimeout (still full), PeerDead / PeerClosed."},
    {"try_push", (PyCFunction)(void (*)(void))RingCall_try_push, METH_FASTCALL | METH_KEYWORDS,
     "try_push(kind, seq, a0=0, ..., a5=0, *, status=0, flags=0)\n--\n\n"
     "Pushes one descriptor if there is room; False when the ring is full."},
    {"pop", (PyCFunction)(void (*)(void))RingCall_pop, METH_FASTCALL | METH_KEYWORDS,
     "pop(timeout=None)\n--\n\n"
     "Pops one descriptor (a Desc), waiting up to timeout s (None: no limit).\n"
     "Raises RingTimeout, or PeerDead / PeerClosed once the ring is empty and the producer is "
     "gone."},
    {"try_pop", (PyCFunction)RingCall_try_pop, METH_NOARGS,
     "try_pop()\n--\n\nPops one descriptor (a Desc), or None when the ring is empty."},
    {"_set_handle", (PyCFunction)(void (*)(void))RingCall_set_handle, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RingCall_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hpkv._ringcall.RingCall",
    .tp_basicsize = sizeof(RingCall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Base of hpkv.ring.Ring: its single-descriptor push and pop.",
    .tp_methods = RingCall_methods,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------------------ module */

/* bind(calls_address: int, desc_type: type): the native core's call table and the Desc class. */
static PyObject *bind(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyType_Check(args[1]) ||
        !PyType_IsSubtype((PyTypeObject *)args[1], &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "bind(calls_address: int, desc_type: tuple subclass)");
        return NULL;
    }
    const struct hpkv_ring_calls *c = PyLong_AsVoidPtr(args[0]);
    if (!c) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "bind(): null call table");
        return NULL;
    }
    if (c->size != sizeof *c || c->version != HPKV_RING_CALLS_VERSION) {
        PyErr_Format(
            PyExc_ImportError,
            "hpkv._ringcall was built against another native core (call table size %u version %u, "
            "expected %zu version %d): rebuild with `pip install -e .`",
            c->size, c->version, sizeof *c, HPKV_RING_CALLS_VERSION);
        return NULL;
    }
    calls = c;
    Py_XSETREF(desc_type, (PyTypeObject *)Py_NewRef(args[1]));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL, "bind(calls_address, desc_type)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "hpkv._ringcall",
    .m_doc = "Fast single-descriptor ring calls (see native/python/ringcall.c).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__ringcall(void)
{
    static const char *const names[KW_COUNT] = {"kind", "seq", "a0",     "a1",    "a2",     "a3",
                                                "a4",   "a5",  "status", "flags", "timeout"};
    for (int i = 0; i < KW_COUNT; i++)
        if (!(kw_names[i] = PyUnicode_InternFromString(names[i])))
            return NULL;
    if (!(str_wait_failed = PyUnicode_InternFromString("_wait_failed")) ||
        !(str_handle = PyUnicode_InternFromString("_handle")) ||
        !(str_misuse = PyUnicode_InternFromString("_misuse")))
        return NULL;
    if (PyType_Ready(&RingCall_Type) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (!m)
        return NULL;
    if (PyModule_AddObjectRef(m, "RingCall", (PyObject *)&RingCall_Type) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
