// CPython module `lowbit.kernels._cpu_kernels`: hands the FFI handlers to Python as capsules
// and exposes the instruction-set switch. No binding library: the surface is five functions.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string>

#include "dispatch.h"
#include "ffi_handlers.h"

namespace {

PyObject* Capsule(void* fn) { return PyCapsule_New(fn, nullptr, nullptr); }

// targets() -> dict[str, capsule]
PyObject* Targets(PyObject*, PyObject*) {
  PyObject* d = PyDict_New();
  if (d == nullptr) return nullptr;
  const struct {
    const char* name;
    void* fn;
  } entries[] = {
      {"lowbit_wo_linear", reinterpret_cast<void*>(&LowbitWoLinear)},
      {"lowbit_w8a8_linear", reinterpret_cast<void*>(&LowbitW8A8Linear)},
      {"lowbit_w8a8_linear_q", reinterpret_cast<void*>(&LowbitW8A8LinearQ)},
      {"lowbit_w8a8_int32", reinterpret_cast<void*>(&LowbitW8A8Int32)},
      {"lowbit_w4a8_linear", reinterpret_cast<void*>(&LowbitW4A8Linear)},
      {"lowbit_decode_attention", reinterpret_cast<void*>(&LowbitDecodeAttention)},
      {"lowbit_wo_dequantize", reinterpret_cast<void*>(&LowbitWoDequantize)},
      {"lowbit_gguf_linear", reinterpret_cast<void*>(&LowbitGgufLinear)},
      {"lowbit_gguf_dequantize", reinterpret_cast<void*>(&LowbitGgufDequantize)},
      {"lowbit_gguf_tile", reinterpret_cast<void*>(&LowbitGgufTile)},
      {"lowbit_row_sum", reinterpret_cast<void*>(&LowbitRowSum)},
  };
  for (const auto& e : entries) {
    PyObject* cap = Capsule(e.fn);
    if (cap == nullptr || PyDict_SetItemString(d, e.name, cap) != 0) {
      Py_XDECREF(cap);
      Py_DECREF(d);
      return nullptr;
    }
    Py_DECREF(cap);
  }
  return d;
}

// kinds() -> list[(id, name, pair_bytes, lut, zero_point)]: the weight-only kind table.
PyObject* Kinds(PyObject*, PyObject*) {
  PyObject* list = PyList_New(lowbit::kNumKinds);
  if (list == nullptr) return nullptr;
  for (int i = 0; i < lowbit::kNumKinds; ++i) {
    const lowbit::KindInfo& k = lowbit::kKindTable[i];
    PyObject* t = Py_BuildValue("(isiOi)", k.id, k.name, k.pair_bytes, k.lut ? Py_True : Py_False,
                                k.zero_point);
    if (t == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, i, t);
  }
  return list;
}

// isa() -> str: the active instruction-set path.
PyObject* Isa(PyObject*, PyObject*) { return PyUnicode_FromString(lowbit::ActiveIsa()->name); }

// supported_isas() -> list[str], slowest first.
PyObject* SupportedIsas(PyObject*, PyObject*) {
  const auto names = lowbit::SupportedIsas();
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(names.size()));
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < names.size(); ++i) {
    PyObject* s = PyUnicode_FromString(names[i].c_str());
    if (s == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), s);
  }
  return list;
}

// set_isa(name) -> str: selects `name` capped by the CPU; returns the path now active.
PyObject* SetIsa(PyObject*, PyObject* arg) {
  const char* name = PyUnicode_AsUTF8(arg);
  if (name == nullptr) return nullptr;
  const std::string chosen = lowbit::SelectIsa(name);
  if (chosen.empty()) {
    PyErr_Format(PyExc_ValueError,
                 "isa=%R is not known; expected one of 'scalar', 'avx2', 'avx2vnni', "
                 "'avx512bw', 'avx512vnni', 'amx'",
                 arg);
    return nullptr;
  }
  return PyUnicode_FromString(chosen.c_str());
}

PyMethodDef kMethods[] = {
    {"targets", Targets, METH_NOARGS, "FFI handler capsules by target name."},
    {"kinds", Kinds, METH_NOARGS, "Weight-only kinds: (id, name, pair_bytes, lut, zero_point)."},
    {"isa", Isa, METH_NOARGS, "Name of the active instruction-set path."},
    {"supported_isas", SupportedIsas, METH_NOARGS, "Paths this CPU can run, slowest first."},
    {"set_isa", SetIsa, METH_O, "Select a path (capped by the CPU); returns the active name."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT, "_cpu_kernels", "lowbit CPU kernels (XLA FFI handlers).", -1,
    kMethods, nullptr, nullptr, nullptr, nullptr,
};

}  // namespace

PyMODINIT_FUNC PyInit__cpu_kernels() { return PyModule_Create(&kModule); }
