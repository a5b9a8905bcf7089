// CHECK(cond, printf-style message): counts a failure and reports it without stopping, so that one
// run of a C++ test shows every broken case (up to 20). Shared by the C++ tests run from pytest.
#pragma once

#include <cstdio>
#include <cstdlib>

namespace nanscan_test {
inline int failures = 0;
}  // namespace nanscan_test

#define CHECK(cond, ...)                                                            \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      ++nanscan_test::failures;                                                     \
      std::fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                            \
      std::fprintf(stderr, "\n");                                                   \
      if (nanscan_test::failures > 20) std::exit(1);                                \
    }                                                                               \
  } while (0)
