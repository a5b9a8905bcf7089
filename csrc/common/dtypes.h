// Element formats nanscan reads, and how to decode each one.
//
// Every backend decodes raw bits through these codecs, so "what is a NaN in e4m3fn" or "how does a
// subnormal fp16 become a float" is written exactly once. The codecs work on the raw storage word
// (never on a compiler's half type) so that the same code compiles in gcc without CUDA headers and in
// nvcc device code, and so that classification is a pure bit test that no compiler flag can delete.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__)
#define NANSCAN_HD __host__ __device__ __forceinline__
#else
#define NANSCAN_HD inline __attribute__((always_inline))
#endif

namespace nanscan {

// Stable tags shared by the op layer and the kernels. Values are part of the launcher ABI.
enum class DType : int32_t {
  Float32 = 0,
  Float64 = 1,
  Float16 = 2,
  BFloat16 = 3,
  Float8E4M3FN = 4,
  Float8E5M2 = 5,
};

constexpr int kNumDTypes = 6;

NANSCAN_HD constexpr int element_size(DType d) {
  return d == DType::Float64 ? 8 : d == DType::Float32 ? 4 : (d == DType::Float16 || d == DType::BFloat16) ? 2 : 1;
}

// scan_difference's pairs (the update watch's copies and weights), the one statement of which it
// admits: the differences are kept in a before of float32 or float64, and an after is never wider
// than its before (op_args.cpp refuses the rest with its words; the CUDA launcher checks its plan).
NANSCAN_HD constexpr bool keeps_differences(DType before) {
  return before == DType::Float32 || before == DType::Float64;
}
NANSCAN_HD constexpr bool no_wider_than(DType after, DType before) {
  return before == DType::Float64 || after != DType::Float64;
}

NANSCAN_HD float bits_to_float(uint32_t bits) {
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

NANSCAN_HD uint32_t float_to_bits(float f) {
  uint32_t b;
  memcpy(&b, &f, sizeof b);
  return b;
}

NANSCAN_HD double bits_to_double(uint64_t bits) {
  double d;
  memcpy(&d, &bits, sizeof d);
  return d;
}

// fp16 magnitude (sign cleared, 15 bits) to the fp32 magnitude with the same value, branch-free so
// that it vectorises: normals are re-biased, subnormals go through an exact int -> float conversion
// (no denormal arithmetic, which is slow on x86), Inf/NaN keep their payload under an all-ones exponent.
NANSCAN_HD uint32_t half_magnitude_to_float_bits(uint32_t mag) {
  const uint32_t normal = (mag << 13) + ((127u - 15u) << 23);
  const uint32_t subnormal =
      float_to_bits(static_cast<float>(static_cast<int32_t>(mag)) * 5.9604644775390625e-8f);  // 2^-24
  const uint32_t special = (mag << 13) | 0x7f800000u;
  return mag >= 0x7c00u ? special : (mag < 0x0400u ? subnormal : normal);
}

// Rounding a float back to a 16-bit format, round-to-nearest-even, with torch's (c10's) results bit
// for bit: overflow goes to Inf, NaN becomes the canonical quiet NaN (bf16 0x7fc0, fp16 0x7e00).
// Branch-free integer arithmetic, so the same code vectorises on the CPU and runs on the GPU.
NANSCAN_HD uint16_t float_to_bfloat16_bits(float f) {
  const uint32_t x = float_to_bits(f);
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
}

NANSCAN_HD uint16_t float_to_half_bits(float f) {
  const uint32_t x = float_to_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t mag = x & 0x7fffffffu;
  // Normal halves: re-bias the exponent and round the 13 dropped mantissa bits to nearest even.
  const uint32_t normal = (mag + ((15u - 127u) << 23) + 0xfffu + ((mag >> 13) & 1u)) >> 13;
  // Subnormal halves (|f| < 2^-14): adding 0.5 aligns the value so the FPU's own round-to-nearest-even
  // drops exactly the bits a half cannot hold; both operands are normal floats.
  const uint32_t subnormal = float_to_bits(bits_to_float(mag) + 0.5f) - 0x3f000000u;
  const uint32_t finite = mag < 0x38800000u ? subnormal : normal;
  const uint32_t special = mag > 0x7f800000u ? 0x7e00u : 0x7c00u;  // NaN, or Inf / overflow
  return static_cast<uint16_t>(sign | (mag >= 0x477ff000u ? special : finite));
}

// A codec names the storage word, its magnitude mask, the first magnitude that is not finite, and
// whether that magnitude is an Inf (IEEE formats) or already a NaN (e4m3fn, which has no Inf).
// decode() returns the exact value in Wide (float for every format but fp64); encode(), where a
// format has one (not float8: torch cannot compute in it either), rounds a Wide back like torch does.
struct Float32Codec {
  using Raw = uint32_t;
  using Wide = float;
  static constexpr Raw kMagnitudeMask = 0x7fffffffu;
  static constexpr Raw kFirstNonFinite = 0x7f800000u;
  static constexpr bool kHasInf = true;
  NANSCAN_HD static float decode(Raw r) { return bits_to_float(r); }
  NANSCAN_HD static Raw encode(float v) { return float_to_bits(v); }
};

struct Float64Codec {
  using Raw = uint64_t;
  using Wide = double;
  static constexpr Raw kMagnitudeMask = 0x7fffffffffffffffull;
  static constexpr Raw kFirstNonFinite = 0x7ff0000000000000ull;
  static constexpr bool kHasInf = true;
  NANSCAN_HD static double decode(Raw r) { return bits_to_double(r); }
  NANSCAN_HD static Raw encode(double v) {
    Raw r;
    memcpy(&r, &v, sizeof r);
    return r;
  }
};

struct BFloat16Codec {
  using Raw = uint16_t;
  using Wide = float;
  static constexpr Raw kMagnitudeMask = 0x7fff;
  static constexpr Raw kFirstNonFinite = 0x7f80;
  static constexpr bool kHasInf = true;
  NANSCAN_HD static float decode(Raw r) { return bits_to_float(static_cast<uint32_t>(r) << 16); }
  NANSCAN_HD static Raw encode(float v) { return float_to_bfloat16_bits(v); }
};

// fp16 bits to the float of the same value. On the GPU the conversion unit does it exactly in one
// instruction; the integer version above is for CPUs, where it vectorises (and a software decode
// costs a GPU ~15 instructions per element, more than HBM bandwidth leaves room for). The two agree
// on every input but a NaN's payload, which nothing downstream reads.
NANSCAN_HD float half_bits_to_float(uint16_t r) {
#if defined(__CUDA_ARCH__)
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(r));
  return f;
#else
  const uint32_t sign = (static_cast<uint32_t>(r) & 0x8000u) << 16;
  return bits_to_float(sign | half_magnitude_to_float_bits(r & 0x7fffu));
#endif
}

struct Float16Codec {
  using Raw = uint16_t;
  using Wide = float;
  static constexpr Raw kMagnitudeMask = 0x7fff;
  static constexpr Raw kFirstNonFinite = 0x7c00;
  static constexpr bool kHasInf = true;
  NANSCAN_HD static float decode(Raw r) { return half_bits_to_float(r); }
  NANSCAN_HD static Raw encode(float v) { return float_to_half_bits(v); }
};

// e5m2 is the upper byte of an fp16: same exponent width and bias, two mantissa bits.
struct Float8E5M2Codec {
  using Raw = uint8_t;
  using Wide = float;
  static constexpr Raw kMagnitudeMask = 0x7f;
  static constexpr Raw kFirstNonFinite = 0x7c;
  static constexpr bool kHasInf = true;
  NANSCAN_HD static float decode(Raw r) {
    return Float16Codec::decode(static_cast<uint16_t>(static_cast<uint16_t>(r) << 8));
  }
};

// e4m3fn: bias 7, no Inf; only S.1111.111 (0x7f / 0xff) is NaN, so 0x78..0x7e are finite (up to 448).
struct Float8E4M3FNCodec {
  using Raw = uint8_t;
  using Wide = float;
  static constexpr Raw kMagnitudeMask = 0x7f;
  static constexpr Raw kFirstNonFinite = 0x7f;
  static constexpr bool kHasInf = false;
  NANSCAN_HD static float decode(Raw r) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    // sm_89+ converts e4m3 pairs to fp16 pairs exactly (0x7f/0xff to NaN); with the byte in both
    // halves of the pair, either half of the result is the value.
    uint32_t pair;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(pair) : "h"(static_cast<uint16_t>(r * 0x0101u)));
    return half_bits_to_float(static_cast<uint16_t>(pair));
#else
    const uint32_t mag = r & 0x7fu;
    const uint32_t sign = (static_cast<uint32_t>(r) & 0x80u) << 24;
    const uint32_t normal = (mag << 20) + ((127u - 7u) << 23);
    const uint32_t subnormal = float_to_bits(static_cast<float>(static_cast<int32_t>(mag)) * 0.001953125f);  // 2^-9
    const uint32_t nan = 0x7fc00000u;
    return bits_to_float(sign | (mag == 0x7fu ? nan : (mag < 0x08u ? subnormal : normal)));
#endif
  }
};

// Formats torch can compute in have an encode(); float8 has none.
template <class Codec, class = void>
struct HasEncode : std::false_type {};
template <class Codec>
struct HasEncode<Codec, std::void_t<decltype(Codec::encode(typename Codec::Wide()))>> : std::true_type {};

}  // namespace nanscan
