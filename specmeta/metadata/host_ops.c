/* A build's host work on seq_lens_cpu in one compiled call (design §3): the check of every
 * length, FlashInfer's host mirrors, the turn of their ring (design §3.3), and FA3's result
 * for a new max L.
 *
 * Each function reads the engine's seq_lens_cpu and checks every length against
 * [0, max_len] before writing anything. stats() returns max L and the sum; the mirror writers
 * write the index pointers that plan() reads into the host buffers whose addresses they were
 * given, and return the sum. A length outside the range raises IndexError and writes nothing;
 * the caller names the value in its message.
 *
 * The rules are those of the torch functions the Python side names beside each entry point;
 * tests compare the two exactly. Offsets are int32 that wrap modulo 2**32 as the kernels'
 * int32 stores do (unsigned arithmetic here: signed overflow is undefined in C).
 *
 * Arguments are positional, those fixed for a result first (bound once with
 * functools.partial), the lengths tensor last. The lengths arrive as the torch tensor itself,
 * and are read only once it is seen to be a contiguous 1-D int32 or int64 CPU tensor of
 * `batch` values (TypeError or ValueError otherwise, before anything is read): its dtype is
 * compared with the dtypes given to init(), its address comes from data_ptr().
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* The loops over every length and offset are compiled twice where the compiler can: for AVX2
 * (eight 32-bit lanes, 64-bit compares) and for the baseline, chosen once when the module loads
 * by the CPU it runs on. */
#ifndef VECTOR /* defined empty, the baseline alone (a test builds it so) */
#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define VECTOR __attribute__((target_clones("avx2", "default")))
#endif
#endif
#endif
#ifndef VECTOR
#define VECTOR
#endif

static PyObject *int64_dtype, *int32_dtype; /* from init() */
/* From init(): tensor_layout's native read of a lengths tensor (1: read; 0: not a contiguous
 * 1-D int32/int64 CPU tensor of `batch` values, which the checks below then name), or NULL. */
typedef int (*lengths_view_fn)(PyObject *, Py_ssize_t, const void **, int *);
static lengths_view_fn lengths_view;
static PyObject *data_ptr_name, *dtype_name, *shape_name, *is_cpu_name, *is_contiguous_name;

typedef struct {
  const void *data;
  int wide; /* int64 values, else int32 */
} Lengths;

/* Whether `attr` of `obj` (called without arguments when `call`) is True; -1 on an error. */
static int is_true(PyObject *obj, PyObject *attr, int call) {
  PyObject *v = call ? PyObject_CallMethodNoArgs(obj, attr) : PyObject_GetAttr(obj, attr);
  if (v == NULL) return -1;
  int yes = v == Py_True;
  Py_DECREF(v);
  return yes;
}

/* The address and width of a lengths tensor of `batch` values, after checking that it is one;
 * 0 with a Python error set otherwise. */
static int lengths_of(PyObject *tensor, Py_ssize_t batch, Lengths *out) {
  if (int64_dtype == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "host_ops.init() was not called");
    return 0;
  }
  if (lengths_view != NULL && lengths_view(tensor, batch, &out->data, &out->wide)) return 1;
  PyObject *dtype = PyObject_GetAttr(tensor, dtype_name);
  if (dtype == NULL) {
    if (PyErr_ExceptionMatches(PyExc_AttributeError)) { /* not a tensor: a TypeError */
      PyErr_Clear();
      PyErr_SetString(PyExc_TypeError, "seq_lens_cpu must be an int32 or int64 tensor");
    }
    return 0;
  }
  out->wide = dtype == int64_dtype;
  int narrow = dtype == int32_dtype;
  Py_DECREF(dtype);
  if (!out->wide && !narrow) {
    PyErr_SetString(PyExc_TypeError, "seq_lens_cpu must be an int32 or int64 tensor");
    return 0;
  }
  PyObject *shape = PyObject_GetAttr(tensor, shape_name);
  if (shape == NULL) return 0;
  int one_row = PyTuple_Check(shape) && PyTuple_GET_SIZE(shape) == 1 &&
                PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, 0)) == batch;
  Py_DECREF(shape);
  if (PyErr_Occurred()) return 0;
  if (!one_row) {
    PyErr_Format(PyExc_ValueError, "seq_lens_cpu must have shape [%zd] (one length a request)",
                 batch);
    return 0;
  }
  int cpu = is_true(tensor, is_cpu_name, 0);
  int contiguous = cpu == 1 ? is_true(tensor, is_contiguous_name, 1) : 0;
  if (cpu < 0 || contiguous < 0) return 0;
  if (!cpu || !contiguous) {
    PyErr_SetString(PyExc_ValueError, "seq_lens_cpu must be a contiguous CPU tensor");
    return 0;
  }
  PyObject *ptr = PyObject_CallMethodNoArgs(tensor, data_ptr_name);
  if (ptr == NULL) return 0;
  out->data = PyLong_AsVoidPtr(ptr);
  Py_DECREF(ptr);
  return !PyErr_Occurred();
}

static inline int64_t length_at(const Lengths *lens, Py_ssize_t i) {
  return lens->wide ? ((const int64_t *)lens->data)[i] : ((const int32_t *)lens->data)[i];
}

/* ΣL, max L and whether some length is outside [0, max_len], in one pass with no branch. */
#define SUM_IN_RANGE(type)                                                                      \
  do {                                                                                          \
    const type *v = (const type *)lens->data;                                                   \
    for (Py_ssize_t i = 0; i < batch; ++i) {                                                    \
      long long x = v[i];                                                                       \
      sum += x;                                                                                 \
      top = x > top ? x : top;                                                                  \
      bad |= (unsigned long long)x > (unsigned long long)max_len;                               \
    }                                                                                           \
  } while (0)

VECTOR static int sum_in_range(const Lengths *lens, Py_ssize_t batch, long long max_len,
                               long long *sum_out, long long *top_out) {
  long long sum = 0, top = 0;
  int bad = 0;
  if (lens->wide)
    SUM_IN_RANGE(int64_t);
  else
    SUM_IN_RANGE(int32_t);
  *sum_out = sum;
  *top_out = top;
  return bad;
}

/* Every length in [0, max_len]: their sum, or -1 with IndexError set (nothing written), and
 * the largest in *high when high is not NULL. A length outside the range is looked for again
 * only to name it. */
static long long checked_sum(const Lengths *lens, Py_ssize_t batch, long long max_len,
                             long long *high) {
  long long sum, top;
  if (max_len < 0) { /* the unsigned compare would let every length through */
    PyErr_Format(PyExc_ValueError, "max_len must be >= 0, got %lld", max_len);
    return -1;
  }
  int bad = sum_in_range(lens, batch, max_len, &sum, &top);
  if (high != NULL) *high = top;
  if (!bad) return sum;
  for (Py_ssize_t i = 0; i < batch; ++i) {
    int64_t v = length_at(lens, i);
    if (v < 0 || v > max_len) {
      PyErr_Format(PyExc_IndexError, "seq_lens_cpu[%zd] = %lld is outside [0, %lld]", i,
                   (long long)v, max_len);
      return -1;
    }
  }
  return -1; /* unreachable: a length was outside the range */
}

/* Reads `count` integers from `args`; 0 with a Python error set on failure. */
static int ints(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t count, const char *name,
                long long *out) {
  if (nargs != count + 1) {
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", name, count + 1, nargs);
    return 0;
  }
  for (Py_ssize_t i = 0; i < count; ++i) {
    out[i] = PyLong_AsLongLong(args[i]);
    if (out[i] == -1 && PyErr_Occurred()) return 0;
  }
  return 1;
}

static PyObject *init(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError,
                    "init(torch.int64, torch.int32, lengths_view or None) takes 3 arguments");
    return NULL;
  }
  lengths_view_fn view = NULL;
  if (args[2] != Py_None) {
    view = (lengths_view_fn)PyCapsule_GetPointer(args[2], "specmeta_tensor_layout.lengths_view");
    if (view == NULL) return NULL;
  }
  lengths_view = view;
  PyObject *old64 = int64_dtype, *old32 = int32_dtype;
  Py_INCREF(args[0]);
  Py_INCREF(args[1]);
  int64_dtype = args[0];
  int32_dtype = args[1];
  Py_XDECREF(old64);
  Py_XDECREF(old32);
  Py_RETURN_NONE;
}

/* stats(max_len, batch, seq_lens_cpu) -> (max L, ΣL), max L = 0 for an empty batch
 *
 * The check of every builder whose host scalars read max L (FA3, TRT-LLM MLA): every length
 * in [0, max_len], then the two numbers those scalars and the launchers' capacity checks read.
 */
static PyObject *stats(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  long long a[2];
  Lengths lens;
  if (!ints(args, nargs, 2, "stats", a) || !lengths_of(args[2], (Py_ssize_t)a[1], &lens))
    return NULL;
  long long max_len = a[0], batch = a[1];
  long long high = 0, sum = checked_sum(&lens, batch, max_len, &high);
  if (sum < 0) return NULL;
  return Py_BuildValue("(LL)", high, sum);
}

/* dst[i] = src[i] + i·step for i < n, two disjoint rows. */
static inline void add_ramp(uint32_t *restrict dst, const uint32_t *restrict src, Py_ssize_t n,
                            uint32_t step) {
  uint32_t ramp = 0; /* i·step by additions: SSE2, the compiler's baseline, has no 32-bit mul */
  for (Py_ssize_t i = 0; i < n; ++i, ramp += step) dst[i] = src[i] + ramp;
}

/* Row 0 of draft decode's kv_indptr, `width` branches a request (draft_rows below). */
#define ROW0(width)                                                                             \
  for (Py_ssize_t b = 0; b < batch; ++b, z += (width)) {                                        \
    uint32_t L = (uint32_t)length_at(lens, b), start = acc + (uint32_t)z;                       \
    for (long long t = 0; t < (width); ++t) out[z + t] = start + (uint32_t)t * (L + 1);         \
    acc += L * (uint32_t)(width);                                                               \
  }

/* DraftDecodeIndptr's rule: out[s * stride + z] = base[z] + z·(s + 1) for s < rows and
 * z ≤ batch·topk, base the cumulative sum of every branch's prefix length (branch z of
 * request z / topk holds L). */
VECTOR static void draft_rows(const Lengths *lens, Py_ssize_t batch, long long topk,
                              long long rows, uint32_t *out, long long stride) {
  /* row 0: base[z] + z; branch t of request b starts at acc_b + t·L, z = z_b + t */
  uint32_t acc = 0;
  Py_ssize_t z = 0;
  switch (topk) { /* the usual widths as constants: the inner loop unrolls into vector stores */
    case 1: ROW0(1); break;
    case 2: ROW0(2); break;
    case 4: ROW0(4); break;
    case 8: ROW0(8); break;
    default: ROW0(topk);
  }
  out[z] = acc + (uint32_t)z;
  for (long long s = 1; s < rows; ++s) /* row s: row 0 + z·s (rows do not overlap) */
    add_ramp(out + s * stride, out, z + 1, (uint32_t)s);
}

/* draft_decode(max_len, topk, rows, out, stride, batch, seq_lens_cpu) -> ΣL: draft_rows. */
static PyObject *draft_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  long long a[6];
  Lengths lens;
  if (!ints(args, nargs, 6, "draft_decode", a) || !lengths_of(args[6], (Py_ssize_t)a[5], &lens))
    return NULL;
  long long max_len = a[0], topk = a[1], rows = a[2], stride = a[4], batch = a[5];
  long long sum = checked_sum(&lens, batch, max_len, NULL);
  if (sum < 0) return NULL;
  if (rows > 0) draft_rows(&lens, batch, topk, rows, (uint32_t *)(uintptr_t)a[3], stride);
  return PyLong_FromLongLong(sum);
}

/* prefix(max_len, shift, scale, out, scaled, batch, seq_lens_cpu) -> ΣL
 *
 * The prefill modes' and the cascade's rule: out[0] = 0, out[i + 1] = out[i] + L_i + shift
 * (the cumulative sum of L + shift), and, when `scaled` is not 0, scaled[i] = scale·out[i]
 * (target verify's mask offsets, N·kv_indptr). */
static PyObject *prefix(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  long long a[6];
  Lengths lens;
  if (!ints(args, nargs, 6, "prefix", a) || !lengths_of(args[6], (Py_ssize_t)a[5], &lens))
    return NULL;
  long long max_len = a[0], batch = a[5];
  uint32_t shift = (uint32_t)a[1], scale = (uint32_t)a[2];
  uint32_t *out = (uint32_t *)(uintptr_t)a[3], *scaled = (uint32_t *)(uintptr_t)a[4];
  long long sum = checked_sum(&lens, batch, max_len, NULL);
  if (sum < 0) return NULL;
  uint32_t acc = 0;
  out[0] = 0;
  for (Py_ssize_t i = 0; i < batch; ++i) {
    acc += (uint32_t)length_at(&lens, i) + shift;
    out[i + 1] = acc;
  }
  if (scaled != NULL)
    for (Py_ssize_t i = 0; i <= batch; ++i) scaled[i] = scale * out[i];
  return PyLong_FromLongLong(sum);
}

/* Row s of the paged rule (paged_rows below), a page count and last-page length of `tokens`
 * by PAGES and IN_PAGE. */
#define PAGED_ROW(PAGES, IN_PAGE)                                                               \
  for (Py_ssize_t b = 0; b < batch; ++b, z += topk) {                                           \
    uint64_t tokens = (uint64_t)length_at(lens, b) + (uint64_t)s; /* ≤ max_len + rows */        \
    uint32_t pages = (uint32_t)(PAGES) + 1, in_last = (uint32_t)(IN_PAGE) + 1;                  \
    switch (topk) { /* the usual widths as constants: vector stores */                          \
      case 1: branches(row + z + 1, tail + z, acc, pages, in_last, 1); break;                   \
      case 2: branches(row + z + 1, tail + z, acc, pages, in_last, 2); break;                   \
      case 4: branches(row + z + 1, tail + z, acc, pages, in_last, 4); break;                   \
      case 8: branches(row + z + 1, tail + z, acc, pages, in_last, 8); break;                   \
      default: branches(row + z + 1, tail + z, acc, pages, in_last, topk);                      \
    }                                                                                           \
    acc += pages * (uint32_t)topk;                                                              \
  }

/* One request's `width` branches in one row of the paged rule: offsets after `acc`. */
static inline void branches(uint32_t *restrict offsets, uint32_t *restrict tails, uint32_t acc,
                            uint32_t pages, uint32_t in_last, long long width) {
  for (long long t = 0; t < width; ++t) {
    offsets[t] = acc + (uint32_t)(t + 1) * pages;
    tails[t] = in_last;
  }
}

/* branch_kv_indptr's rule: branch z (request z / topk, prefix L) at step s holds
 * ceil((L + s + 1) / page_size) pages, its last one (L + s) mod page_size + 1 tokens;
 * out[s * stride + ·] is the cumulative sum of the pages with out[s * stride] = 0, and
 * last[s * last_stride + z] the last page's tokens. A power-of-two page size (every usual
 * one, 1 included) divides by a shift and a mask rather than a division per request. */
VECTOR static void paged_rows(const Lengths *lens, Py_ssize_t batch, long long topk,
                              long long rows, long long page_size, uint32_t *out,
                              long long stride, uint32_t *last, long long last_stride) {
  uint64_t ps = (uint64_t)page_size, mask = ps - 1;
  int shift = 0;
  while (((uint64_t)1 << shift) < ps) ++shift;
  for (long long s = 0; s < rows; ++s) {
    uint32_t *row = out + s * stride, *tail = last + s * last_stride, acc = 0;
    Py_ssize_t z = 0;
    row[0] = 0;
    if ((ps & mask) == 0)
      PAGED_ROW(tokens >> shift, tokens & mask)
    else
      PAGED_ROW(tokens / ps, tokens % ps)
  }
}

/* paged(max_len, topk, rows, page_size, out, stride, last, last_stride, batch, seq_lens_cpu)
 *   -> ΣL: paged_rows. */
static PyObject *paged(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  long long a[9];
  Lengths lens;
  if (!ints(args, nargs, 9, "paged", a) || !lengths_of(args[9], (Py_ssize_t)a[8], &lens))
    return NULL;
  long long max_len = a[0], page_size = a[3], batch = a[8];
  if (page_size < 1) {
    PyErr_Format(PyExc_ValueError, "paged: page_size must be >= 1, got %lld", page_size);
    return NULL;
  }
  long long sum = checked_sum(&lens, batch, max_len, NULL);
  if (sum < 0) return NULL;
  paged_rows(&lens, batch, a[1], a[2], page_size, (uint32_t *)(uintptr_t)a[4], a[5],
             (uint32_t *)(uintptr_t)a[6], a[7]);
  return PyLong_FromLongLong(sum);
}

/* ring_take(state, current_stream, device) -> slot
 *
 * The turn of a HostMirrorRing (host_mirrors.py, whose docstring gives the schedule): build j
 * takes set j % depth; every E-th build (j > 0) first records event (j / E) % count on the
 * current stream, and a build j >= depth with (j - depth) % E == 0 waits for event
 * ((j - depth) / E + 1) % count. The driver is called directly, without the Python layers
 * around torch's events: `state` is the address of an int64 array
 *   [builds, depth, E, count, cuEventRecord, cuEventQuery, cuEventSynchronize, event 0, ...]
 * whose function addresses are 0 for a CPU ring (no events). `current_stream(device)` gives
 * the raw stream handle; it is called only on a build that records. A wait queries the event
 * first and blocks, with the GIL released, only if the device has not passed it. The count
 * moves on only once the driver calls succeeded; a failed call raises RuntimeError with its
 * CUresult. */
typedef int (*record_fn)(void *, void *);
typedef int (*event_fn)(void *);

/* -1, with the RuntimeError of a failed driver call set. */
static long long driver_error(const char *call, int code) {
  PyErr_Format(PyExc_RuntimeError, "HostMirrorRing: %s returned CUresult %d", call, code);
  return -1;
}

/* The slot of the ring's next build (the schedule above), or -1 with a Python error set. */
static long long take_turn(PyObject *state, PyObject *current_stream, PyObject *device) {
  int64_t *st = (int64_t *)PyLong_AsVoidPtr(state);
  if (st == NULL) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "ring_take: state is NULL");
    return -1;
  }
  int64_t j = st[0], depth = st[1], every = st[2], count = st[3];
  if (st[4] != 0) {
    if (j > 0 && j % every == 0) {
      PyObject *raw = PyObject_CallOneArg(current_stream, device);
      if (raw == NULL) return -1;
      void *stream = PyLong_AsVoidPtr(raw);
      Py_DECREF(raw);
      if (PyErr_Occurred()) return -1;
      void *event = (void *)(intptr_t)st[7 + (j / every) % count];
      int code = ((record_fn)(intptr_t)st[4])(event, stream);
      if (code != 0) return driver_error("cuEventRecord", code);
    }
    if (j >= depth && (j - depth) % every == 0) {
      void *event = (void *)(intptr_t)st[7 + ((j - depth) / every + 1) % count];
      int code = ((event_fn)(intptr_t)st[5])(event);
      if (code == 600) { /* CUDA_ERROR_NOT_READY: the host is half a ring ahead */
        Py_BEGIN_ALLOW_THREADS
        code = ((event_fn)(intptr_t)st[6])(event);
        Py_END_ALLOW_THREADS
        if (code != 0) return driver_error("cuEventSynchronize", code);
      } else if (code != 0) {
        return driver_error("cuEventQuery", code);
      }
    }
  }
  st[0] = j + 1;
  return j % depth;
}

static PyObject *ring_take(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "ring_take(state, current_stream, device) takes 3 arguments");
    return NULL;
  }
  long long slot = take_turn(args[0], args[1], args[2]);
  return slot < 0 ? NULL : PyLong_FromLongLong(slot);
}

/* mirror_step(state, current_stream, device, made, slow, seq_lens_cpu) -> result
 *
 * A FlashInfer host step in one call (flashinfer.py, _mirrored): the ring's turn as ring_take
 * takes it, then, when made[slot] holds the set's (result, writer), the writer on
 * seq_lens_cpu and the result. A set whose result is not made yet, and lengths the writer
 * refuses (TypeError, ValueError, IndexError: nothing written), go to slow(slot, seq_lens_cpu),
 * which makes the result or raises the builder's message. */
static PyObject *mirror_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 6) {
    PyErr_SetString(PyExc_TypeError,
                    "mirror_step(state, current_stream, device, made, slow, seq_lens_cpu) takes "
                    "6 arguments");
    return NULL;
  }
  long long slot = take_turn(args[0], args[1], args[2]);
  if (slot < 0) return NULL;
  PyObject *made = args[3];
  if (!PyList_Check(made) || slot >= PyList_GET_SIZE(made)) {
    PyErr_SetString(PyExc_TypeError, "mirror_step: made must be a list with a slot per set");
    return NULL;
  }
  PyObject *entry = PyList_GET_ITEM(made, slot);
  if (PyTuple_Check(entry) && PyTuple_GET_SIZE(entry) == 2) {
    Py_INCREF(entry);
    PyObject *total = PyObject_CallOneArg(PyTuple_GET_ITEM(entry, 1), args[5]);
    if (total != NULL) {
      Py_DECREF(total);
      PyObject *result = PyTuple_GET_ITEM(entry, 0);
      Py_INCREF(result);
      Py_DECREF(entry);
      return result;
    }
    Py_DECREF(entry);
    if (!PyErr_ExceptionMatches(PyExc_TypeError) && !PyErr_ExceptionMatches(PyExc_ValueError) &&
        !PyErr_ExceptionMatches(PyExc_IndexError))
      return NULL;
    PyErr_Clear(); /* the slow path refuses the same lengths, with the builder's message */
  }
  PyObject *index = PyLong_FromLongLong(slot);
  if (index == NULL) return NULL;
  PyObject *argv[2] = {index, args[5]};
  PyObject *result = PyObject_Vectorcall(args[4], argv, 2, NULL);
  Py_DECREF(index);
  return result;
}

/* raised(recipe, top) -> a result made for max L = 0, its normal passes' maxima raised by top
 * (fa3.py, _raiser; the Python copy there is the rule this follows).
 *
 * recipe = (cls, fields, name, sub): a new cls object, made without __init__ as
 * object.__new__ makes it, whose __dict__ is a copy of the dict `fields` with `name` set to
 * sub + top when sub is an int, to the object of sub when sub is a recipe, and to a tuple of
 * the objects of its recipes when sub is a tuple of recipes. A recipe met twice in one call
 * gives one object (a normal pass shared by every step stays shared). */
#define RAISED_MEMO 64
typedef struct {
  PyObject *recipe[RAISED_MEMO];
  PyObject *made[RAISED_MEMO]; /* borrowed: held by the object being built */
  int count;
} Made;

static PyObject *dict_name; /* "__dict__" */

static PyObject *raise_recipe(PyObject *recipe, long long top, Made *memo, int depth);

static PyObject *raise_value(PyObject *sub, long long top, Made *memo, int depth) {
  if (PyLong_CheckExact(sub)) {
    long long high = PyLong_AsLongLong(sub);
    if (high == -1 && PyErr_Occurred()) return NULL;
    return PyLong_FromLongLong(high + top);
  }
  if (!PyTuple_Check(sub)) {
    PyErr_SetString(PyExc_TypeError, "raised: a recipe's sub is an int, a recipe or a tuple of "
                                     "recipes");
    return NULL;
  }
  Py_ssize_t n = PyTuple_GET_SIZE(sub);
  if (n == 4 && PyType_Check(PyTuple_GET_ITEM(sub, 0)))
    return raise_recipe(sub, top, memo, depth);
  PyObject *out = PyTuple_New(n);
  if (out == NULL) return NULL;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject *item = raise_recipe(PyTuple_GET_ITEM(sub, i), top, memo, depth);
    if (item == NULL) {
      Py_DECREF(out);
      return NULL;
    }
    PyTuple_SET_ITEM(out, i, item);
  }
  return out;
}

static PyObject *raise_recipe(PyObject *recipe, long long top, Made *memo, int depth) {
  if (depth > 8 || !PyTuple_Check(recipe) || PyTuple_GET_SIZE(recipe) != 4 ||
      !PyType_Check(PyTuple_GET_ITEM(recipe, 0)) || !PyDict_Check(PyTuple_GET_ITEM(recipe, 1))) {
    PyErr_SetString(PyExc_TypeError, "raised: a recipe is (cls, fields dict, name, sub), nested "
                                     "at most 8 deep");
    return NULL;
  }
  for (int i = 0; i < memo->count; ++i) {
    if (memo->recipe[i] == recipe) {
      Py_INCREF(memo->made[i]);
      return memo->made[i];
    }
  }
  PyObject *value = raise_value(PyTuple_GET_ITEM(recipe, 3), top, memo, depth + 1);
  if (value == NULL) return NULL;
  PyObject *fields = PyDict_Copy(PyTuple_GET_ITEM(recipe, 1));
  if (fields == NULL || PyDict_SetItem(fields, PyTuple_GET_ITEM(recipe, 2), value) < 0) {
    Py_XDECREF(fields);
    Py_DECREF(value);
    return NULL;
  }
  Py_DECREF(value);
  PyTypeObject *cls = (PyTypeObject *)PyTuple_GET_ITEM(recipe, 0);
  PyObject *obj = cls->tp_alloc(cls, 0);
  if (obj == NULL || PyObject_GenericSetAttr(obj, dict_name, fields) < 0) {
    Py_XDECREF(obj);
    Py_DECREF(fields);
    return NULL;
  }
  Py_DECREF(fields);
  if (memo->count < RAISED_MEMO) {
    memo->recipe[memo->count] = recipe;
    memo->made[memo->count++] = obj;
  }
  return obj;
}

static PyObject *raised(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyLong_CheckExact(args[1])) {
    PyErr_SetString(PyExc_TypeError, "raised(recipe, top) takes a recipe and an int");
    return NULL;
  }
  long long top = PyLong_AsLongLong(args[1]);
  if (top == -1 && PyErr_Occurred()) return NULL;
  Made memo;
  memo.count = 0;
  return raise_recipe(args[0], top, &memo, 0);
}

static PyMethodDef methods[] = {
    {"init", (PyCFunction)(void (*)(void))init, METH_FASTCALL,
     "init(torch.int64, torch.int32, lengths_view or None): the dtypes of the lengths, and "
     "tensor_layout's native read of a lengths tensor (None: read through Python)."},
    {"stats", (PyCFunction)(void (*)(void))stats, METH_FASTCALL,
     "stats(max_len, batch, seq_lens_cpu) -> (max L, sum)"},
    {"draft_decode", (PyCFunction)(void (*)(void))draft_decode, METH_FASTCALL,
     "draft_decode(max_len, topk, rows, out, stride, batch, seq_lens_cpu) -> sum"},
    {"prefix", (PyCFunction)(void (*)(void))prefix, METH_FASTCALL,
     "prefix(max_len, shift, scale, out, scaled, batch, seq_lens_cpu) -> sum"},
    {"paged", (PyCFunction)(void (*)(void))paged, METH_FASTCALL,
     "paged(max_len, topk, rows, page_size, out, stride, last, last_stride, batch, "
     "seq_lens_cpu) -> sum"},
    {"ring_take", (PyCFunction)(void (*)(void))ring_take, METH_FASTCALL,
     "ring_take(state, current_stream, device) -> the slot of the ring's next build"},
    {"mirror_step", (PyCFunction)(void (*)(void))mirror_step, METH_FASTCALL,
     "mirror_step(state, current_stream, device, made, slow, seq_lens_cpu) -> result"},
    {"raised", (PyCFunction)(void (*)(void))raised, METH_FASTCALL,
     "raised(recipe, top) -> a result with its normal passes' maxima raised by top"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "specmeta_host_ops",
                                    "A build's host work on seq_lens_cpu (specmeta design §3).", -1,
                                    methods};

PyMODINIT_FUNC PyInit_specmeta_host_ops(void) {
  data_ptr_name = PyUnicode_InternFromString("data_ptr");
  dtype_name = PyUnicode_InternFromString("dtype");
  shape_name = PyUnicode_InternFromString("shape");
  is_cpu_name = PyUnicode_InternFromString("is_cpu");
  is_contiguous_name = PyUnicode_InternFromString("is_contiguous");
  dict_name = PyUnicode_InternFromString("__dict__");
  if (!data_ptr_name || !dtype_name || !shape_name || !is_cpu_name || !is_contiguous_name ||
      !dict_name)
    return NULL;
  return PyModule_Create(&module);
}
