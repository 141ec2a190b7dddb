#pragma once
#include <string>

#ifndef FASTPAR_VERSION_STRING
#define FASTPAR_VERSION_STRING "unknown"
#endif

namespace fastpar {
// "key=value;..." facts about how this extension was compiled (version, compiler, cuda=0/1).
std::string build_info();
}  // namespace fastpar
