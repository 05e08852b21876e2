// The per-step check of the bound memory as one compiled loop (refit_core/endpoints/compiled_check.py builds it).
//
// A fast filter: each function returns -1 when every tensor is provably the memory recorded at the bind (the
// same storage object, at the same address and size, the same offset in it), else the index of the first
// item it could not prove so; the Python check (refit_core/endpoints/binding.py) then names the change, or
// finds none. It reads pointers and sizes, never a tensor's bytes, and holds the GIL throughout.
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>

namespace {

struct Record {
  const void* storage;  // the StorageImpl: the same object, even if new memory landed at the old address
  const void* data;     // its memory now (null once freed, another address once reallocated)
  int64_t nbytes;
  int64_t offset;       // the tensor's storage offset, in elements
};

// False for anything that is not a tensor with a plain storage (the Python check then decides): no C++
// exception may leave this module (a symbolic size, say, throws).
bool read(PyObject* item, Record* out) {
  if (!THPVariable_CheckExact(item) && !THPVariable_Check(item)) return false;
  try {
    const at::Tensor& tensor = THPVariable_Unpack(item);
    c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
    if (!impl->has_storage()) return false;
    const c10::Storage& storage = impl->unsafe_storage();
    out->storage = storage.unsafeGetStorageImpl();
    out->data = storage.data();
    out->nbytes = static_cast<int64_t>(storage.nbytes());
    out->offset = impl->storage_offset();
    return true;
  } catch (...) {
    return false;
  }
}

bool same(PyObject* item, const Record& recorded) {
  Record now;
  return read(item, &now) && now.storage == recorded.storage && now.data == recorded.data &&
         now.nbytes == recorded.nbytes && now.offset == recorded.offset;
}

// The tensor of ``item``: the item itself (field < 0) or its ``field``-th element (a (name, tensor) pair).
PyObject* tensor_of(PyObject* item, Py_ssize_t field) {
  if (field < 0) return item;
  if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) <= field) return nullptr;
  return PyTuple_GET_ITEM(item, field);
}

// record(tensors) -> bytes: what first_moved compares against.
PyObject* record(PyObject*, PyObject* tensors) {
  PyObject* items = PySequence_Fast(tensors, "record() takes a sequence of tensors");
  if (items == nullptr) return nullptr;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
  PyObject* out = PyBytes_FromStringAndSize(nullptr, n * static_cast<Py_ssize_t>(sizeof(Record)));
  if (out != nullptr) {
    Record* records = reinterpret_cast<Record*>(PyBytes_AS_STRING(out));
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!read(PySequence_Fast_GET_ITEM(items, i), &records[i])) {
        Py_CLEAR(out);
        PyErr_Format(PyExc_TypeError, "record(): item %zd is not a tensor with a storage", i);
        break;
      }
    }
  }
  Py_DECREF(items);
  return out;
}

// first_moved(items, record, field) -> int: the first of ``items`` (tensors, or pairs whose ``field``-th element
// is the tensor) that is not provably its record; -1 if none.
PyObject* first_moved(PyObject*, PyObject* args) {
  PyObject* sequence;
  Py_buffer recorded;
  Py_ssize_t field;
  if (!PyArg_ParseTuple(args, "Oy*n", &sequence, &recorded, &field)) return nullptr;
  PyObject* items = PySequence_Fast(sequence, "first_moved() takes a sequence");
  if (items == nullptr) {
    PyBuffer_Release(&recorded);
    return nullptr;
  }
  Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
  const Record* records = static_cast<const Record*>(recorded.buf);
  Py_ssize_t found = recorded.len == n * static_cast<Py_ssize_t>(sizeof(Record)) ? -1 : 0;
  for (Py_ssize_t i = 0; found < 0 && i < n; ++i) {
    PyObject* tensor = tensor_of(PySequence_Fast_GET_ITEM(items, i), field);
    if (tensor == nullptr || !same(tensor, records[i])) found = i;
  }
  Py_DECREF(items);
  PyBuffer_Release(&recorded);
  return PyLong_FromSsize_t(found);
}

// The __dict__ of ``object`` (borrowed), null if it has none.
PyObject* dict_of(PyObject* object) {
  PyObject** dict = _PyObject_GetDictPtr(object);
  return dict == nullptr || *dict == nullptr || !PyDict_CheckExact(*dict) ? nullptr : *dict;
}

// The value of ``name`` in ``dict`` (borrowed), null if absent.
PyObject* attribute(PyObject* dict, PyObject* name) {
  PyObject* value = PyDict_GetItemWithError(dict, name);
  if (value == nullptr) PyErr_Clear();
  return value;
}

constexpr Py_ssize_t kAhead = 8;  // first_piece_moved asks for pieces (2 x) and their dicts (1 x) this far ahead

bool equal(PyObject* now, PyObject* then) {
  if (now == then) return true;
  int answer = PyObject_RichCompareBool(now, then, Py_EQ);
  if (answer < 0) PyErr_Clear();  // undecided: the Python check decides
  return answer == 1;
}

// first_piece_moved(pieces, specs, boxes, viewed, record) -> int: the first piece whose spec or box is not the
// one bound, whose having a view changed (``viewed``: one byte a piece), or whose view is not provably the
// memory recorded (one record per viewed piece); -1 if none.
PyObject* first_piece_moved(PyObject*, PyObject* args) {
  static PyObject* const spec_name = PyUnicode_InternFromString("spec");
  static PyObject* const box_name = PyUnicode_InternFromString("box");
  static PyObject* const view_name = PyUnicode_InternFromString("view");
  PyObject *sequence, *specs, *boxes;
  Py_buffer viewed, recorded;
  if (!PyArg_ParseTuple(args, "OO!O!y*y*", &sequence, &PyTuple_Type, &specs, &PyTuple_Type, &boxes, &viewed,
                        &recorded)) {
    return nullptr;
  }
  PyObject* items = PySequence_Fast(sequence, "first_piece_moved() takes a sequence of pieces");
  if (items == nullptr) {
    PyBuffer_Release(&viewed);
    PyBuffer_Release(&recorded);
    return nullptr;
  }
  Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
  const char* has_view = static_cast<const char*>(viewed.buf);
  const Record* records = static_cast<const Record*>(recorded.buf);
  Py_ssize_t record_count = recorded.len / static_cast<Py_ssize_t>(sizeof(Record));
  Py_ssize_t found = PyTuple_GET_SIZE(specs) == n && PyTuple_GET_SIZE(boxes) == n && viewed.len == n ? -1 : 0;
  PyObject** pieces = PySequence_Fast_ITEMS(items);
  Py_ssize_t next_record = 0;
  for (Py_ssize_t i = 0; found < 0 && i < n; ++i) {
    if (i + 2 * kAhead < n) __builtin_prefetch(pieces[i + 2 * kAhead]);
    if (i + kAhead < n) {
      PyObject* ahead = dict_of(pieces[i + kAhead]);
      if (ahead != nullptr) __builtin_prefetch(ahead);
    }
    PyObject* attributes = dict_of(pieces[i]);
    PyObject* spec = attributes == nullptr ? nullptr : attribute(attributes, spec_name);
    PyObject* box = spec == nullptr ? nullptr : attribute(attributes, box_name);
    PyObject* view = box == nullptr ? nullptr : attribute(attributes, view_name);
    if (view == nullptr || !equal(spec, PyTuple_GET_ITEM(specs, i)) || !equal(box, PyTuple_GET_ITEM(boxes, i)) ||
        (has_view[i] != 0) == (view == Py_None)) {
      found = i;
    } else if (has_view[i]) {
      if (next_record >= record_count || !same(view, records[next_record])) found = i;
      ++next_record;
    }
  }
  Py_DECREF(items);
  PyBuffer_Release(&viewed);
  PyBuffer_Release(&recorded);
  return PyLong_FromSsize_t(found);
}

PyMethodDef methods[] = {
    {"record", record, METH_O, "record(tensors) -> bytes"},
    {"first_moved", first_moved, METH_VARARGS, "first_moved(items, record, field) -> int"},
    {"first_piece_moved", first_piece_moved, METH_VARARGS,
     "first_piece_moved(pieces, specs, boxes, viewed, record) -> int"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "refit_compiled_check", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_refit_compiled_check() { return PyModule_Create(&module); }
