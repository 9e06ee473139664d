/* The token mail's decode post in C (issue 25): one call reads a decode batch's requests and writes its records
 * straight into the mail's ring, where the Python path (kvcanary.sglang.tokens.expected_token_columns, then
 * TokenMail.post) ran a loop of attribute reads per request and then one struct pack per column.
 *
 * Built and loaded by kvcanary/runtime/host_ext.py (a CPython extension, not a kernel: it reads Python objects).
 * Engine-agnostic: the caller names the request's attributes (its row, and the two lists whose concatenation is the
 * row's tokens).
 *
 * fill_decode(reqs, mirror, names, columns, at, capacity, rows, width, step) -> int
 *   reqs     a sequence of requests
 *   mirror   dict: row -> [a callable returning the request last sent (a weakref), tokens sent, last token sent]
 *   names    (row attribute, first token list attribute, second token list attribute): the row's tokens are
 *            first + second, and a decode row's new token is second[-1]
 *   columns  the ring: the addresses of its int64 [capacity] columns of rows, starts, tokens and steps (host memory;
 *            the caller's layout, kvcanary.kernels.layout.TOKEN_MAIL_FIELD_*)
 *   at       the ring slot of the first record; records wrap at capacity
 *   rows, width  the table's bounds: a record with a row or start outside them is refused
 *   step     every record's step
 * Returns len(reqs) when every request is a decode row (the same request as the mirror's, exactly one token more
 * than sent, the token before it the last one sent), each in bounds with int tokens: its record written at
 * at + i (mod capacity) and its mirror entry updated ([1] = tokens now, [2] = the new token). Otherwise -1, with the
 * mirror as it was (records may have been written past what the caller publishes: never read); the caller then
 * takes the Python path, which applies the same rule to every request. An exception is never raised for a request
 * that does not fit (the Python path handles and reports it); only a bad call (wrong argument types) raises.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

enum { kColumns = 4 }; /* rows, starts, tokens, steps */

/* A mirror entry changed by this call, and what it held, to put back when a later request is refused. */
typedef struct {
  PyObject *entry; /* owned: held while the call runs (Python code a request's attribute runs could drop the mirror's) */
  PyObject *sent;  /* owned: the entry's old [1] */
  PyObject *last;  /* owned: the entry's old [2] */
} Undo;

/* The object the mirror entry's reference leads to (a new reference), or NULL with no error set when it is gone. */
static PyObject *referent(PyObject *ref) {
  if (PyWeakref_CheckRef(ref)) {
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *obj = NULL;
    if (PyWeakref_GetRef(ref, &obj) < 0) {
      PyErr_Clear();
      return NULL;
    }
    return obj;
#else
    PyObject *obj = PyWeakref_GetObject(ref);
    if (obj == NULL) {
      PyErr_Clear();
      return NULL;
    }
    Py_INCREF(obj);
    return obj;
#endif
  }
  PyObject *obj = PyObject_CallNoArgs(ref); /* a strong-reference stand-in (objects without weak references) */
  if (obj == NULL) PyErr_Clear();
  return obj;
}

/* A Python int's value as int64 in *out: 0 for an int that fits, -1 (no error set) for anything else. */
static int as_int64(PyObject *value, int64_t *out) {
  if (!PyLong_Check(value)) return -1;
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
  if (overflow || (v == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return -1;
  }
  *out = (int64_t)v;
  return 0;
}

/* One request's record when it is a decode row (0; *entry_out and *token_out new references), else -1 (no error set).
 * The rule of the Python fast path, in its order: row attribute, mirror entry, the same request, one token more,
 * the token before it the last one sent. */
static int decode_record(PyObject *req, PyObject *mirror, PyObject *const names[3], int64_t rows, int64_t width,
                         int64_t record[3], PyObject **entry_out, PyObject **token_out, int64_t *total_out) {
  int result = -1;
  PyObject *row = NULL, *entry = NULL, *last = NULL, *first = NULL, *second = NULL, *referenced = NULL,
           *before = NULL, *token = NULL;
  row = PyObject_GetAttr(req, names[0]);
  if (row == NULL || !PyLong_CheckExact(row)) goto done; /* (a row that is not an int: the Python path) */
  entry = PyDict_GetItemWithError(mirror, row); /* borrowed, then owned */
  if (entry == NULL || !PyList_CheckExact(entry) || PyList_GET_SIZE(entry) != 3) {
    entry = NULL;
    goto done;
  }
  Py_INCREF(entry);
  last = PyList_GET_ITEM(entry, 2);
  Py_INCREF(last); /* (the comparison below may run Python code) */
  int64_t sent;
  if (as_int64(PyList_GET_ITEM(entry, 1), &sent) != 0) goto done;
  referenced = referent(PyList_GET_ITEM(entry, 0));
  if (referenced != req) goto done;
  first = PyObject_GetAttr(req, names[1]);
  if (first == NULL) goto done;
  second = PyObject_GetAttr(req, names[2]);
  if (second == NULL) goto done;
  Py_ssize_t n_first = PyObject_Size(first), n_second = PyObject_Size(second);
  if (n_first < 0 || n_second < 2) goto done; /* (an output of one token: the Python path's output[-2] raises) */
  int64_t total = (int64_t)n_first + (int64_t)n_second;
  if (total != sent + 1) goto done;
  before = PySequence_GetItem(second, n_second - 2);
  if (before == NULL) goto done;
  int same = PyObject_RichCompareBool(before, last, Py_EQ);
  if (same != 1) goto done;
  token = PySequence_GetItem(second, n_second - 1);
  if (token == NULL) goto done;
  int64_t row_value, token_value;
  if (as_int64(row, &row_value) != 0 || as_int64(token, &token_value) != 0) goto done;
  /* the mail's bounds (the Python post packs rows and starts unsigned, tokens signed) */
  if (row_value < 0 || row_value >= rows || sent < 0 || sent >= width) goto done;
  record[0] = row_value;
  record[1] = sent;
  record[2] = token_value;
  if (PyList_GET_SIZE(entry) != 3) goto done; /* (changed by Python code the reads above ran) */
  *entry_out = entry;
  *token_out = token;
  *total_out = total;
  entry = token = NULL; /* handed to the caller */
  result = 0;
done:
  if (result != 0) PyErr_Clear(); /* a request that does not fit is the Python path's to handle, not an error */
  Py_XDECREF(row);
  Py_XDECREF(entry);
  Py_XDECREF(last);
  Py_XDECREF(first);
  Py_XDECREF(second);
  Py_XDECREF(referenced);
  Py_XDECREF(before);
  Py_XDECREF(token);
  return result;
}

/* Put back every entry changed so far, in reverse (a row twice in one batch: its first old values last), and let go
 * of the entries. */
static void undo_all(Undo *undo, Py_ssize_t count) {
  for (Py_ssize_t i = count - 1; i >= 0; --i) {
    PyList_SetItem(undo[i].entry, 1, undo[i].sent); /* steals the references */
    PyList_SetItem(undo[i].entry, 2, undo[i].last);
    Py_DECREF(undo[i].entry);
  }
}

static PyObject *fill_decode(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
  (void)module;
  if (nargs != 9) {
    PyErr_Format(PyExc_TypeError, "fill_decode: 9 arguments, got %zd", nargs);
    return NULL;
  }
  PyObject *reqs = args[0], *mirror = args[1], *names = args[2];
  if (!PyDict_Check(mirror)) {
    PyErr_SetString(PyExc_TypeError, "fill_decode: mirror must be a dict");
    return NULL;
  }
  if (!PyTuple_Check(names) || PyTuple_GET_SIZE(names) != 3) {
    PyErr_SetString(PyExc_TypeError, "fill_decode: names must be a tuple of 3 attribute names");
    return NULL;
  }
  PyObject *const name_items[3] = {PyTuple_GET_ITEM(names, 0), PyTuple_GET_ITEM(names, 1),
                                   PyTuple_GET_ITEM(names, 2)};
  for (int i = 0; i < 3; ++i) {
    if (!PyUnicode_Check(name_items[i])) {
      PyErr_SetString(PyExc_TypeError, "fill_decode: names must be a tuple of 3 attribute names");
      return NULL;
    }
  }
  PyObject *columns = args[3];
  if (!PyTuple_Check(columns) || PyTuple_GET_SIZE(columns) != kColumns) {
    PyErr_SetString(PyExc_TypeError, "fill_decode: columns must be a tuple of 4 addresses");
    return NULL;
  }
  int64_t *column[kColumns];
  for (int i = 0; i < kColumns; ++i) {
    column[i] = (int64_t *)(uintptr_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(columns, i));
  }
  long long at = PyLong_AsLongLong(args[4]);
  long long capacity = PyLong_AsLongLong(args[5]);
  long long rows = PyLong_AsLongLong(args[6]);
  long long width = PyLong_AsLongLong(args[7]);
  long long step = PyLong_AsLongLong(args[8]);
  if (PyErr_Occurred()) return NULL;
  if (capacity < 1 || at < 0 || at >= capacity) {
    PyErr_Format(PyExc_ValueError, "fill_decode: at %lld, capacity %lld: not a ring slot", at, capacity);
    return NULL;
  }
  for (int i = 0; i < kColumns; ++i) {
    if (column[i] == NULL) {
      PyErr_SetString(PyExc_ValueError, "fill_decode: a column address is 0");
      return NULL;
    }
  }
  /* a tuple (a list is copied): its items stay put whatever Python code a request's attribute runs */
  PyObject *seq = PySequence_Tuple(reqs);
  if (seq == NULL) return NULL;
  Py_ssize_t n = PyTuple_GET_SIZE(seq);
  if (n == 0 || n > capacity) {
    Py_DECREF(seq);
    return PyLong_FromLong(-1);
  }
  PyObject **items = &PyTuple_GET_ITEM(seq, 0);
  Undo *undo = PyMem_Malloc((size_t)n * sizeof(Undo));
  if (undo == NULL) {
    Py_DECREF(seq);
    return PyErr_NoMemory();
  }
  Py_ssize_t done = 0;
  long long slot = at;
  for (; done < n; ++done) {
    int64_t record[3];
    PyObject *entry = NULL, *token = NULL;
    int64_t total = 0;
    if (decode_record(items[done], mirror, name_items, rows, width, record, &entry, &token, &total) != 0) break;
    PyObject *total_obj = PyLong_FromLongLong(total);
    if (total_obj == NULL) {
      Py_DECREF(entry);
      Py_DECREF(token);
      undo_all(undo, done);
      PyMem_Free(undo);
      Py_DECREF(seq);
      return NULL;
    }
    /* the entry updated in place, as the Python path does (a row twice in one batch sees the first update) */
    undo[done].entry = entry;
    undo[done].sent = PyList_GET_ITEM(entry, 1);
    undo[done].last = PyList_GET_ITEM(entry, 2);
    Py_INCREF(undo[done].sent);
    Py_INCREF(undo[done].last);
    PyList_SetItem(entry, 1, total_obj); /* steals; drops the list's reference to the old value (undo holds one) */
    PyList_SetItem(entry, 2, token);
    column[0][slot] = record[0];
    column[1][slot] = record[1];
    column[2][slot] = record[2];
    column[3][slot] = (int64_t)step;
    if (++slot == capacity) slot = 0;
  }
  if (done < n) {
    undo_all(undo, done);
    PyMem_Free(undo);
    Py_DECREF(seq);
    return PyLong_FromLong(-1);
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    Py_DECREF(undo[i].sent);
    Py_DECREF(undo[i].last);
    Py_DECREF(undo[i].entry);
  }
  PyMem_Free(undo);
  Py_DECREF(seq);
  return PyLong_FromSsize_t(n);
}

static PyMethodDef methods[] = {
    {"fill_decode", (PyCFunction)(void (*)(void))fill_decode, METH_FASTCALL,
     "fill_decode(reqs, mirror, names, columns, at, capacity, rows, width, step) -> int: a decode batch's token "
     "mail records written and its mirror entries updated (len(reqs)), or -1 with the mirror unchanged."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_kvcanary_decode_post", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kvcanary_decode_post(void) { return PyModule_Create(&module_def); }
