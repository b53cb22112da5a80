// The one assertion macro of the C++ tests: count a failed expectation, report where, keep going.
#pragma once

#include <cstdio>

inline int& expect_failures() {
  static int failures = 0;
  return failures;
}

#define EXPECT(cond)                                                                          \
  do {                                                                                        \
    if (!(cond)) {                                                                            \
      std::fprintf(stderr, "%s:%d: expectation failed: %s\n", __FILE__, __LINE__, #cond); \
      ++expect_failures();                                                                    \
    }                                                                                         \
  } while (0)
