#pragma once
// Calls into Python from the torch.distributed backend's threads (csrc/c10d_backend.cpp,
// csrc/c10d_ipc.cpp): the makers that set a group's communicators up and the owners that close
// them.
#include <Python.h>

#include <string>

namespace fastpar {

// Holds the GIL for its scope.
class Gil {
 public:
  Gil() : state_(PyGILState_Ensure()) {}
  ~Gil() { PyGILState_Release(state_); }
  Gil(const Gil&) = delete;
  Gil& operator=(const Gil&) = delete;

 private:
  PyGILState_STATE state_;
};

// Whether Python can still be called (not before initialisation nor during finalisation: a
// backend freed at exit must not touch the interpreter).
bool python_alive();

// The pending Python exception's text, the exception cleared (GIL held).
std::string take_python_error();

// owner.<method>() with any exception dropped, then the reference to owner released; nothing
// where owner is null or Python is gone. Takes the GIL.
void call_and_release(PyObject* owner, const char* method);

// Py_XDECREF under the GIL (nothing where Python is gone). Takes the GIL.
void release_python(PyObject* obj);

}  // namespace fastpar
