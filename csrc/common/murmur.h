// MurmurHash3's 32-bit finalizer: every input bit moves every output bit with probability ~1/2. One
// definition for the replica checksum (scan_rules.h) and the update sketch's hash (sketch_rules.h).
#pragma once

#include <cstdint>

#include "dtypes.h"  // NANSCAN_HD

namespace nanscan {

// A template so that the CPU applies this one definition to SIMD vectors of words too (GCC vector
// extensions), where Word is a vector of uint32 and the operators act per lane.
template <class Word>
NANSCAN_HD Word murmur_finalizer(Word x) {
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x;
}

}  // namespace nanscan
