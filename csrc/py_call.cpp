// Calls into Python from the backend's threads: see py_call.h.
#include "py_call.h"

namespace fastpar {

bool python_alive() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

std::string take_python_error() {
  PyObject *type, *value, *trace;
  PyErr_Fetch(&type, &value, &trace);
  PyObject* text = value != nullptr ? PyObject_Str(value) : nullptr;
  const char* utf8 = text != nullptr ? PyUnicode_AsUTF8(text) : nullptr;
  std::string error = utf8 != nullptr ? utf8 : "unknown error";
  Py_XDECREF(text);
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(trace);
  PyErr_Clear();
  return error;
}

void call_and_release(PyObject* owner, const char* method) {
  if (owner == nullptr || !python_alive()) return;
  Gil gil;
  PyObject* r = PyObject_CallMethod(owner, method, nullptr);
  if (r == nullptr) {
    PyErr_Clear();
  } else {
    Py_DECREF(r);
  }
  Py_DECREF(owner);
}

void release_python(PyObject* obj) {
  if (obj == nullptr || !python_alive()) return;
  Gil gil;
  Py_DECREF(obj);
}

}  // namespace fastpar
