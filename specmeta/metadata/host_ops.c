/* A build's host work on seq_lens_cpu in one compiled call (design §3): the check of every
 * length, and FlashInfer's host mirrors (design §3.3).
 *
 * Each function reads the engine's seq_lens_cpu and checks every length against
 * [0, max_len] before writing anything. stats() returns (max L, ΣL); the mirror writers
 * write the index pointers that plan() reads into the host buffers they are given, and return
 * the same pair (ragged() the pair of the verify lengths too), so a builder's host part makes
 * one call. A length outside the range raises IndexError and writes nothing; the caller names
 * the value in its message.
 *
 * The rules are those of the torch functions the Python side names beside each entry point;
 * tests compare the two exactly. Offsets are int32 that wrap modulo 2**32 as the kernels'
 * int32 stores do (unsigned arithmetic here: signed overflow is undefined in C).
 *
 * The module holds no address it does not own. Every call gets what it reads and writes as
 * objects: the output buffers through the buffer protocol (the numpy views of the pinned
 * mirror tensors, made once by the Python side; a view keeps its tensor alive), taken and
 * released within the call and checked on every call (a writable int32 buffer of the shape the
 * call writes, rows in order and unit stride within a row); and the lengths as the torch
 * tensor itself, read only once it is seen to be a contiguous 1-D int32 or int64 CPU tensor of
 * `batch` values (TypeError or ValueError otherwise, before anything is read): its dtype is
 * compared with the dtypes given to init(), its address comes from data_ptr() during the call.
 *
 * Arguments are positional, those fixed for a result first (bound once with
 * functools.partial), the lengths tensor last.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static PyObject *int64_dtype, *int32_dtype; /* from init(): owned references */
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
 * 0 with a Python error set otherwise. The address is used within the call only: the caller
 * holds the tensor. */
static int lengths_of(PyObject *tensor, Py_ssize_t batch, Lengths *out) {
  if (int64_dtype == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "host_ops.init() was not called");
    return 0;
  }
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

/* An output view: its first element and its row stride in elements (0 for one dimension). */
typedef struct {
  Py_buffer buffer;
  uint32_t *data;
  Py_ssize_t stride;
} View;

/* `obj`'s buffer as an int32 view of shape [cols] (rows < 0) or [rows, cols] that the writers
 * may fill: writable, 4-byte aligned, unit stride within a row, rows in order and disjoint.
 * 0 with TypeError or ValueError set (nothing kept) otherwise; release it with PyBuffer_Release.
 * A view of shape [rows, cols] with rows = -2 takes whatever rows it has (read from it). */
static int int32_view(PyObject *obj, const char *name, Py_ssize_t rows, Py_ssize_t cols,
                      View *view) {
  if (PyObject_GetBuffer(obj, &view->buffer, PyBUF_RECORDS) < 0) {
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError,
                 "%s must be a writable int32 buffer (the numpy view of a host mirror), got %s",
                 name, Py_TYPE(obj)->tp_name);
    return 0;
  }
  Py_buffer *b = &view->buffer;
  const char *format = b->format != NULL ? b->format : "B";
  if (*format == '@' || *format == '=' || *format == '<') ++format;
  int int32 = b->itemsize == 4 && (strcmp(format, "i") == 0 ||
                                   (sizeof(long) == 4 && strcmp(format, "l") == 0));
  int ndim = rows == -1 ? 1 : 2;
  int ok = int32 && b->ndim == ndim && ((uintptr_t)b->buf & 3) == 0;
  if (ok && ndim == 2 && rows == -2) rows = b->shape[0];
  if (ok) {
    Py_ssize_t width = b->shape[ndim - 1], inner = b->strides[ndim - 1];
    ok = width == cols && (ndim == 1 || b->shape[0] == rows) && (width <= 1 || inner == 4);
    if (ok && ndim == 2 && rows > 1) /* rows in order, none overlapping the one before */
      ok = b->strides[0] % 4 == 0 && b->strides[0] >= cols * 4;
  }
  if (!ok) {
    if (ndim == 1)
      PyErr_Format(PyExc_ValueError,
                   "%s must be an int32 buffer of shape [%zd] with unit stride (format %s, "
                   "itemsize %zd, ndim %d)",
                   name, cols, b->format != NULL ? b->format : "B", b->itemsize, b->ndim);
    else if (rows < 0)
      PyErr_Format(PyExc_ValueError,
                   "%s must be an int32 buffer of shape [rows, %zd], unit stride within a row "
                   "and rows in order (format %s, itemsize %zd, ndim %d)",
                   name, cols, b->format != NULL ? b->format : "B", b->itemsize, b->ndim);
    else
      PyErr_Format(PyExc_ValueError,
                   "%s must be an int32 buffer of shape [%zd, %zd], unit stride within a row "
                   "and rows in order (format %s, itemsize %zd, ndim %d)",
                   name, rows, cols, b->format != NULL ? b->format : "B", b->itemsize, b->ndim);
    PyBuffer_Release(b);
    return 0;
  }
  view->data = (uint32_t *)b->buf;
  view->stride = ndim == 2 && rows > 1 ? b->strides[0] / 4 : 0;
  return 1;
}

/* Every length in [0, max_len]: their sum, or -1 with IndexError set (nothing written), and
 * the largest in *high when high is not NULL. One pass with no branch; a length outside the
 * range is looked for again only to name it. */
static long long checked_sum(const Lengths *lens, Py_ssize_t batch, long long max_len,
                             long long *high) {
  if (max_len < 0) { /* the unsigned compare would let every length through */
    PyErr_Format(PyExc_ValueError, "max_len must be >= 0, got %lld", max_len);
    return -1;
  }
  long long sum = 0, top = 0;
  int bad = 0;
  for (Py_ssize_t i = 0; i < batch; ++i) {
    long long x = length_at(lens, i);
    sum += x;
    top = x > top ? x : top;
    bad |= (unsigned long long)x > (unsigned long long)max_len;
  }
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

/* Reads `count` integers from `args` of a call of `count + extra` arguments; 0 with a Python
 * error set on failure. */
static int ints(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t count, Py_ssize_t extra,
                const char *name, long long *out) {
  if (nargs != count + extra) {
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", name, count + extra, nargs);
    return 0;
  }
  for (Py_ssize_t i = 0; i < count; ++i) {
    out[i] = PyLong_AsLongLong(args[i]);
    if (out[i] == -1 && PyErr_Occurred()) return 0;
  }
  return 1;
}

/* A batch of at least 0 requests and a width of at least 1 (0 with ValueError otherwise). */
static int sizes(const char *call, long long batch, long long width, const char *what) {
  if (batch < 0 || width < 1) {
    PyErr_Format(PyExc_ValueError, "%s: batch must be >= 0 and %s >= 1, got %lld and %lld", call,
                 what, batch, width);
    return 0;
  }
  return 1;
}

static PyObject *init(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "init(torch.int64, torch.int32) takes 2 arguments");
    return NULL;
  }
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
 * in [0, max_len], then the two numbers those scalars read.
 */
static PyObject *stats(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  long long a[2];
  Lengths lens;
  if (!ints(args, nargs, 2, 1, "stats", a) || !lengths_of(args[2], (Py_ssize_t)a[1], &lens))
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
    int64_t full = length_at(lens, b);                                                          \
    uint32_t L = (uint32_t)(full < cap ? full : cap), start = acc + (uint32_t)z;                \
    for (long long t = 0; t < (width); ++t) out[z + t] = start + (uint32_t)t * (L + 1);         \
    acc += L * (uint32_t)(width);                                                               \
  }

/* DraftDecodeIndptr's rule: out[s * stride + z] = base[z] + z·(s + 1) for s < rows and
 * z ≤ batch·topk, base the cumulative sum of every branch's prefix length (branch z of
 * request z / topk holds min(L, cap): cap is a draft window's window + sink, or max_len). */
static void draft_rows(const Lengths *lens, Py_ssize_t batch, long long topk, long long rows,
                       long long cap, uint32_t *out, Py_ssize_t stride) {
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

/* draft_decode(max_len, topk, batch, cap, out, seq_lens_cpu) -> (max L, ΣL): draft_rows into
 * `out`, an int32 buffer of shape [rows, batch·topk + 1], each prefix length taken as
 * min(L, cap). */
static PyObject *draft_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  long long a[4];
  View out;
  Lengths lens;
  if (!ints(args, nargs, 4, 2, "draft_decode", a) || !sizes("draft_decode", a[2], a[1], "topk"))
    return NULL;
  long long max_len = a[0], topk = a[1], batch = a[2], cap = a[3];
  if (cap < 0) {
    PyErr_Format(PyExc_ValueError, "cap must be >= 0, got %lld", cap);
    return NULL;
  }
  if (!int32_view(args[4], "out", -2, batch * topk + 1, &out)) return NULL;
  long long rows = out.buffer.shape[0], sum = -1, high = 0;
  if (lengths_of(args[5], (Py_ssize_t)batch, &lens))
    sum = checked_sum(&lens, batch, max_len, &high);
  if (sum >= 0 && rows > 0) draft_rows(&lens, batch, topk, rows, cap, out.data, out.stride);
  PyBuffer_Release(&out.buffer);
  return sum < 0 ? NULL : Py_BuildValue("(LL)", high, sum);
}

/* prefix(max_len, shift, scale, cap, batch, out, scaled, seq_lens_cpu) -> (max L, ΣL)
 *
 * The prefill modes' and the cascade's rule: out[0] = 0, out[i + 1] = out[i] + min(L_i, cap)
 * + shift (the cumulative sum of L + shift; cap is a draft window's window + sink, or
 * max_len), and, when `scaled` is not None, scaled[i] = scale·out[i] (target verify's mask
 * offsets, N·kv_indptr); both int32 buffers of shape [batch + 1]. */
static PyObject *prefix(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  long long a[5];
  View out, scaled;
  Lengths lens;
  if (!ints(args, nargs, 5, 3, "prefix", a) || !sizes("prefix", a[4], 1, "width")) return NULL;
  long long max_len = a[0], cap = a[3], batch = a[4];
  uint32_t shift = (uint32_t)a[1], scale = (uint32_t)a[2];
  if (cap < 0) {
    PyErr_Format(PyExc_ValueError, "cap must be >= 0, got %lld", cap);
    return NULL;
  }
  int has_scaled = args[6] != Py_None;
  if (!int32_view(args[5], "out", -1, batch + 1, &out)) return NULL;
  if (has_scaled && !int32_view(args[6], "scaled", -1, batch + 1, &scaled)) {
    PyBuffer_Release(&out.buffer);
    return NULL;
  }
  long long sum = -1, high = 0;
  if (lengths_of(args[7], (Py_ssize_t)batch, &lens))
    sum = checked_sum(&lens, batch, max_len, &high);
  if (sum >= 0) {
    uint32_t acc = 0, *o = out.data;
    o[0] = 0;
    for (Py_ssize_t i = 0; i < batch; ++i) {
      int64_t full = length_at(&lens, i);
      acc += (uint32_t)(full < cap ? full : cap) + shift;
      o[i + 1] = acc;
    }
    if (has_scaled)
      for (Py_ssize_t i = 0; i <= batch; ++i) scaled.data[i] = scale * o[i];
  }
  if (has_scaled) PyBuffer_Release(&scaled.buffer);
  PyBuffer_Release(&out.buffer);
  return sum < 0 ? NULL : Py_BuildValue("(LL)", high, sum);
}

/* Row s of the paged rule (paged_rows below), a page count and last-page length of `tokens`
 * by PAGES and IN_PAGE: one request's topk branches a step. */
#define PAGED_ROW(PAGES, IN_PAGE)                                                               \
  for (Py_ssize_t b = 0; b < batch; ++b, z += topk) {                                           \
    uint64_t tokens = (uint64_t)length_at(lens, b) + (uint64_t)s; /* ≤ max_len + rows */        \
    uint32_t pages = (uint32_t)(PAGES) + 1, in_last = (uint32_t)(IN_PAGE) + 1;                  \
    for (long long t = 0; t < topk; ++t) {                                                      \
      row[z + t + 1] = acc + (uint32_t)(t + 1) * pages;                                         \
      tail[z + t] = in_last;                                                                    \
    }                                                                                           \
    acc += pages * (uint32_t)topk;                                                              \
  }

/* branch_kv_indptr's rule: branch z (request z / topk, prefix L) at step s holds
 * ceil((L + s + 1) / page_size) pages, its last one (L + s) mod page_size + 1 tokens;
 * out[s * stride + ·] is the cumulative sum of the pages with out[s * stride] = 0, and
 * last[s * last_stride + z] the last page's tokens. A power-of-two page size (every usual
 * one, 1 included) divides by a shift and a mask rather than a division per request. */
static void paged_rows(const Lengths *lens, Py_ssize_t batch, long long topk, long long rows,
                       long long page_size, uint32_t *out, Py_ssize_t stride, uint32_t *last,
                       Py_ssize_t last_stride) {
  uint64_t ps = (uint64_t)page_size, mask = ps - 1;
  int shift = 0;
  while (((uint64_t)1 << shift) < ps) ++shift;
  for (long long s = 0; s < rows; ++s) {
    uint32_t *restrict row = out + s * stride, *restrict tail = last + s * last_stride, acc = 0;
    Py_ssize_t z = 0;
    row[0] = 0;
    if ((ps & mask) == 0)
      PAGED_ROW(tokens >> shift, tokens & mask)
    else
      PAGED_ROW(tokens / ps, tokens % ps)
  }
}

/* paged(max_len, topk, page_size, batch, out, last, seq_lens_cpu) -> (max L, ΣL): paged_rows
 * into `out` and `last`, int32 buffers of shapes [rows, batch·topk + 1] and
 * [rows, batch·topk]. */
static PyObject *paged(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  long long a[4];
  View out, last;
  Lengths lens;
  if (!ints(args, nargs, 4, 3, "paged", a) || !sizes("paged", a[3], a[1], "topk")) return NULL;
  long long max_len = a[0], topk = a[1], page_size = a[2], batch = a[3];
  if (page_size < 1) {
    PyErr_Format(PyExc_ValueError, "paged: page_size must be >= 1, got %lld", page_size);
    return NULL;
  }
  if (!int32_view(args[4], "out", -2, batch * topk + 1, &out)) return NULL;
  long long rows = out.buffer.shape[0], sum = -1, high = 0;
  if (!int32_view(args[5], "last", rows, batch * topk, &last)) {
    PyBuffer_Release(&out.buffer);
    return NULL;
  }
  if (lengths_of(args[6], (Py_ssize_t)batch, &lens))
    sum = checked_sum(&lens, batch, max_len, &high);
  if (sum >= 0)
    paged_rows(&lens, batch, topk, rows, page_size, out.data, out.stride, last.data, last.stride);
  PyBuffer_Release(&last.buffer);
  PyBuffer_Release(&out.buffer);
  return sum < 0 ? NULL : Py_BuildValue("(LL)", high, sum);
}

/* ragged(max_len, N, T, batch, count, cap, verify_out, qo_out, kv_out, mask_out,
 *        seq_lens_cpu, verify_lens_cpu) -> (max L, ΣL, max v, Σv)
 *
 * A ragged target verify's mirrors over a bucket of `batch` requests and T tokens (the rule of
 * pad_verify_lens_to_bucket_ref on lengths the host checked): the `count` real lengths v_b,
 * each in [0, N] and summing to at most T (ValueError otherwise, nothing written), are kept;
 * the leftover T − Σv goes to the batch − count pad requests, ⌊leftover / pads⌋ each and one
 * more for the first leftover mod pads, or to the last request without a pad. verify_out
 * [batch] ← the padded lengths, qo_out [batch + 1] ← their cumulative sum, kv_out [batch + 1]
 * ← that of min(L, cap) + min(v, N), mask_out [batch + 1] ← that of v·(min(L, cap) + min(v, N))
 * (cap is a window layer's w − 1, or max_len: design §2.10). */
static PyObject *ragged(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  long long a[6];
  View out[4];
  Lengths lens, verify;
  static const char *names[4] = {"verify_out", "qo_out", "kv_out", "mask_out"};
  if (!ints(args, nargs, 6, 6, "ragged", a) || !sizes("ragged", a[3], 1, "width")) return NULL;
  long long max_len = a[0], n = a[1], T = a[2], batch = a[3], count = a[4], cap = a[5];
  if (count < 0 || count > batch || n < 1 || T < 0 || cap < 0) {
    PyErr_Format(PyExc_ValueError, "ragged: need 0 <= count <= batch, N >= 1, T >= 0, cap >= 0; "
                 "got count %lld, batch %lld, N %lld, T %lld, cap %lld", count, batch, n, T, cap);
    return NULL;
  }
  int views = 0;
  for (; views < 4; ++views)
    if (!int32_view(args[6 + views], names[views], -1, batch + (views > 0), &out[views])) break;
  long long sum = -1, high = 0, top = 0;
  if (views == 4 && lengths_of(args[10], (Py_ssize_t)batch, &lens))
    sum = checked_sum(&lens, batch, max_len, &top);
  if (sum >= 0 && !lengths_of(args[11], (Py_ssize_t)count, &verify)) sum = -1;
  long long total = sum >= 0 ? checked_sum(&verify, count, n, &high) : -1;
  if (sum >= 0 && total < 0) sum = -1;
  if (sum >= 0 && total > T) {
    PyErr_Format(PyExc_ValueError, "verify_lens_cpu sums to %lld, over T = %lld", total, T);
    sum = -1;
  }
  if (sum >= 0) {
    long long pads = batch - count, left = T - total;
    long long share = pads ? left / pads : 0, spare = pads ? left % pads : 0;
    uint32_t *v = out[0].data, *qo = out[1].data, *kv = out[2].data, *mask = out[3].data;
    uint32_t q = 0, k = 0, m = 0;
    qo[0] = kv[0] = mask[0] = 0;
    for (Py_ssize_t b = 0; b < batch; ++b) {
      long long rows = b < count ? length_at(&verify, b) : share + (b - count < spare);
      if (!pads && b == batch - 1) rows += left;
      int64_t full = length_at(&lens, b);
      uint32_t cols = (uint32_t)(full < cap ? full : cap) + (uint32_t)(rows < n ? rows : n);
      v[b] = (uint32_t)rows;
      qo[b + 1] = q += (uint32_t)rows;
      kv[b + 1] = k += cols;
      mask[b + 1] = m += (uint32_t)rows * cols;
    }
  }
  while (views-- > 0) PyBuffer_Release(&out[views].buffer);
  return sum < 0 ? NULL : Py_BuildValue("(LLLL)", top, sum, high, total);
}

static PyMethodDef methods[] = {
    {"init", (PyCFunction)(void (*)(void))init, METH_FASTCALL,
     "init(torch.int64, torch.int32): the dtypes of the lengths tensors."},
    {"stats", (PyCFunction)(void (*)(void))stats, METH_FASTCALL,
     "stats(max_len, batch, seq_lens_cpu) -> (max L, sum)"},
    {"draft_decode", (PyCFunction)(void (*)(void))draft_decode, METH_FASTCALL,
     "draft_decode(max_len, topk, batch, cap, out, seq_lens_cpu) -> (max L, sum)"},
    {"prefix", (PyCFunction)(void (*)(void))prefix, METH_FASTCALL,
     "prefix(max_len, shift, scale, cap, batch, out, scaled or None, seq_lens_cpu) -> "
     "(max L, sum)"},
    {"paged", (PyCFunction)(void (*)(void))paged, METH_FASTCALL,
     "paged(max_len, topk, page_size, batch, out, last, seq_lens_cpu) -> (max L, sum)"},
    {"ragged", (PyCFunction)(void (*)(void))ragged, METH_FASTCALL,
     "ragged(max_len, N, T, batch, count, cap, verify_out, qo_out, kv_out, mask_out, "
     "seq_lens_cpu, verify_lens_cpu) -> (max L, sum, max v, sum of v)"},
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
  if (!data_ptr_name || !dtype_name || !shape_name || !is_cpu_name || !is_contiguous_name)
    return NULL;
  return PyModule_Create(&module);
}
