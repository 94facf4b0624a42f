// The layout of torch tensors (address, dtype, device, shape, strides) recorded and compared in
// one native call each (tensor_layout.py; design §4): what a graph runner checks before every
// replay of the tensors its graphs captured. Each tensor is read through torch's own C++ object
// behind the Python one, with no Python attribute call.
//
//   record(t0, t1, ...) -> bytes   the tensors' layouts, packed as int64
//   same(layouts, t0, t1, ...)     True iff the tensors have exactly these layouts
//   lengths_view                   a capsule: host_ops.c's read of a seq_lens_cpu tensor
//
// same() is False for another number of tensors, an argument that is not a tensor, or a tensor
// without storage; it never raises for them. A layout is
//   [address, dtype, device type, device index, rank, size 0, ..., stride 0, ...]
// after one leading count of tensors.
#include <Python.h>

#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// The layouts of one call, packed without a heap allocation for the common case (a few
// tensors of low rank); past `kInline` entries they move to the heap.
class Packed {
 public:
  explicit Packed(int64_t count) { push(count); }
  void push(int64_t v) {
    if (heap_.empty() && size_ < kInline) {
      inline_[size_++] = v;
      return;
    }
    if (heap_.empty()) heap_.assign(inline_, inline_ + size_);
    heap_.push_back(v);
    ++size_;
  }
  const int64_t *data() const { return heap_.empty() ? inline_ : heap_.data(); }
  size_t size() const { return size_; }

 private:
  static constexpr size_t kInline = 128;
  int64_t inline_[kInline];
  std::vector<int64_t> heap_;
  size_t size_ = 0;
};

// Appends the layout of `obj` to `out`; false when it is not a tensor with storage.
bool append_layout(PyObject *obj, Packed &out) {
  if (!THPVariable_Check(obj)) return false;
  const at::Tensor &t = THPVariable_Unpack(obj);
  if (!t.defined() || !t.has_storage()) return false;
  const c10::Device device = t.device();
  out.push(reinterpret_cast<intptr_t>(t.const_data_ptr()));
  out.push(static_cast<int64_t>(t.scalar_type()));
  out.push(static_cast<int64_t>(device.type()));
  out.push(static_cast<int64_t>(device.index()));
  const int64_t rank = t.dim();
  out.push(rank);
  const c10::IntArrayRef sizes = t.sizes(), strides = t.strides();
  for (int64_t d = 0; d < rank; ++d) out.push(sizes[d]);
  for (int64_t d = 0; d < rank; ++d) out.push(strides[d]);
  return true;
}

// Whether the tensor `obj` has the layout at `at` (advanced past it); false otherwise.
bool matches(PyObject *obj, const int64_t *&at, const int64_t *end) {
  if (!THPVariable_Check(obj) || end - at < 5) return false;
  const at::Tensor &t = THPVariable_Unpack(obj);
  if (!t.defined() || !t.has_storage()) return false;
  const int64_t rank = at[4];
  if (t.dim() != rank || end - at < 5 + 2 * rank) return false;
  const c10::Device device = t.device();
  if (reinterpret_cast<intptr_t>(t.const_data_ptr()) != at[0] ||
      static_cast<int64_t>(t.scalar_type()) != at[1] ||
      static_cast<int64_t>(device.type()) != at[2] || static_cast<int64_t>(device.index()) != at[3])
    return false;
  const c10::IntArrayRef sizes = t.sizes(), strides = t.strides();
  for (int64_t d = 0; d < rank; ++d)
    if (sizes[d] != at[5 + d] || strides[d] != at[5 + rank + d]) return false;
  at += 5 + 2 * rank;
  return true;
}

PyObject *record(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
  Packed out(static_cast<int64_t>(nargs));
  try {
    for (Py_ssize_t i = 0; i < nargs; ++i) {
      if (!append_layout(args[i], out)) {
        PyErr_Format(PyExc_TypeError, "record: argument %zd is not a tensor with storage", i);
        return nullptr;
      }
    }
  } catch (const std::exception &err) {
    PyErr_SetString(PyExc_RuntimeError, err.what());
    return nullptr;
  }
  return PyBytes_FromStringAndSize(reinterpret_cast<const char *>(out.data()),
                                   static_cast<Py_ssize_t>(out.size() * sizeof(int64_t)));
}

PyObject *same(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs < 1 || !PyBytes_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "same(layouts, *tensors): layouts must be record()'s bytes");
    return nullptr;
  }
  const char *raw = PyBytes_AS_STRING(args[0]);
  const Py_ssize_t bytes = PyBytes_GET_SIZE(args[0]);
  if (bytes < static_cast<Py_ssize_t>(sizeof(int64_t)) || bytes % sizeof(int64_t) != 0) {
    PyErr_SetString(PyExc_ValueError, "same(): layouts is not record()'s bytes");
    return nullptr;
  }
  // The bytes object's buffer is aligned for any type (CPython allocates it so).
  const int64_t *at = reinterpret_cast<const int64_t *>(raw);
  const int64_t *end = at + bytes / sizeof(int64_t);
  if (*at++ != nargs - 1) Py_RETURN_FALSE;
  try {
    for (Py_ssize_t i = 1; i < nargs; ++i)
      if (!matches(args[i], at, end)) Py_RETURN_FALSE;
  } catch (const std::exception &) {
    Py_RETURN_FALSE;
  }
  if (at != end) Py_RETURN_FALSE;
  Py_RETURN_TRUE;
}

// For host_ops.c (through the capsule `lengths_view`): the address and width of a lengths
// tensor, read without a Python attribute call. 1 when `obj` is a contiguous 1-D int32 or
// int64 CPU tensor of `batch` values, else 0 (the caller's own checks then name what is
// wrong). Never raises.
int lengths_view(PyObject *obj, Py_ssize_t batch, const void **data, int *wide) {
  try {
    if (!THPVariable_Check(obj)) return 0;
    const at::Tensor &t = THPVariable_Unpack(obj);
    if (!t.defined() || !t.has_storage() || t.device().type() != c10::DeviceType::CPU ||
        t.dim() != 1 || t.sizes()[0] != batch || !t.is_contiguous())
      return 0;
    const c10::ScalarType type = t.scalar_type();
    if (type != c10::ScalarType::Long && type != c10::ScalarType::Int) return 0;
    *data = t.const_data_ptr();
    *wide = type == c10::ScalarType::Long;
    return 1;
  } catch (const std::exception &) {
    return 0;
  }
}

PyMethodDef methods[] = {
    {"record", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(record)),
     METH_FASTCALL, "record(*tensors) -> bytes: the tensors' layouts"},
    {"same", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(same)),
     METH_FASTCALL, "same(layouts, *tensors) -> bool: whether the tensors have these layouts"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "specmeta_tensor_layout",
                      "Tensor layouts in one native call (specmeta design §4).", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_specmeta_tensor_layout(void) {
  PyObject *mod = PyModule_Create(&module);
  if (mod == nullptr) return nullptr;
  PyObject *view = PyCapsule_New(reinterpret_cast<void *>(&lengths_view),
                                 "specmeta_tensor_layout.lengths_view", nullptr);
  if (view == nullptr || PyModule_AddObject(mod, "lengths_view", view) < 0) {
    Py_XDECREF(view);
    Py_DECREF(mod);
    return nullptr;
  }
  return mod;
}
