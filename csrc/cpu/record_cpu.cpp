#include "record_cpu.h"

#include <cstdint>
#include <cstring>
#include <vector>

namespace nanscan::cpu {
namespace {

// The source dtypes record_ accepts (ops.cpp checks them first): what a recorder's statistics are
// (int64 counts, float32/float64 statistics, bool flags) and what a caller may hand it as a flag or
// a scale (a GradScaler's float32 found_inf, an integer tensor). Not float16/bfloat16: torch's own
// copy_ to float32 gives a float16 NaN different bits in its vector loop and its scalar tail (0x7fffffff
// and 0x7fc00000 for 0x7e00), so no kernel can match the composite's bytes for them.
// Calls f(static_cast<const T*>(nullptr)) with the C++ type of the dtype code.
template <class F>
void visit_source_type(int32_t dtype, F&& f) {
  const DTypeCodes& c = dtype_codes();
  if (dtype == c.boolean) return f(static_cast<const bool*>(nullptr));
  if (dtype == c.uint8) return f(static_cast<const uint8_t*>(nullptr));
  if (dtype == c.int8) return f(static_cast<const int8_t*>(nullptr));
  if (dtype == c.int16) return f(static_cast<const int16_t*>(nullptr));
  if (dtype == c.int32) return f(static_cast<const int32_t*>(nullptr));
  if (dtype == c.int64) return f(static_cast<const int64_t*>(nullptr));
  if (dtype == c.float32) return f(static_cast<const float*>(nullptr));
  if (dtype == c.float64) return f(static_cast<const double*>(nullptr));
  fail(concat("nanscan.record_: no conversion from ", dtype_name(dtype)));  // ops.cpp refused it already
}

// One row's values, converted to the row's dtype and held until every source of the call has been
// read. Per thread and kept between calls: an append then allocates nothing.
std::vector<unsigned char>& staging(int which) {
  thread_local std::vector<unsigned char> buffers[2];
  return buffers[which];
}

// Converts every element of `sources`, in order, to Out into `out`: the conversion torch's copy_
// applies element by element (a static_cast: round to nearest; NaN stays NaN, bool becomes 0 or 1).
// A negative-bit source never arrives here: torch's negation fallback resolves the op's immutable
// inputs before the kernel.
template <class Out>
void convert_sources(const TensorListArg& sources, Out* out) {
  int64_t offset = 0;
  for (const TensorInfo& given : sources.infos()) {
    // Read in place when contiguous; the rare strided view is made contiguous first, as copy_ would read it.
    OwnedTensor copy;
    const void* data = given.data;
    if (given.numel > 1 && !is_contiguous(given)) {
      copy = contiguous(given.handle);
      data = copy.data();
    }
    const int64_t n = given.numel;
    visit_source_type(given.dtype, [&](auto typed) {
      const auto* in = static_cast<decltype(typed)>(data);
      for (int64_t i = 0; i < n; ++i) out[offset + i] = static_cast<Out>(in[i]);
    });
    offset += n;
  }
}

// `sources` converted to the dtype of `rows` in staging(which): rows.size(1) values.
void stage(const TensorInfo& rows, const TensorListArg& sources, int which) {
  std::vector<unsigned char>& bytes = staging(which);
  if (rows.dtype == dtype_codes().float32) {
    bytes.resize(static_cast<size_t>(rows.size(1)) * sizeof(float));
    convert_sources(sources, reinterpret_cast<float*>(bytes.data()));
  } else {  // float64, the one other dtype ops.cpp lets rows have
    bytes.resize(static_cast<size_t>(rows.size(1)) * sizeof(double));
    convert_sources(sources, reinterpret_cast<double*>(bytes.data()));
  }
}

// Copies staging(which) into row `slot` of `rows`, whatever its strides.
void write_row(const TensorInfo& rows, int64_t slot, int which) {
  const std::vector<unsigned char>& bytes = staging(which);
  const int64_t item = rows.dtype == dtype_codes().float32 ? sizeof(float) : sizeof(double);
  unsigned char* row = static_cast<unsigned char*>(rows.data) + slot * rows.strides[0] * item;
  if (rows.strides[1] == 1) {
    std::memcpy(row, bytes.data(), bytes.size());
    return;
  }
  for (int64_t j = 0; j < rows.size(1); ++j)
    std::memcpy(row + j * rows.strides[1] * item, bytes.data() + j * item, item);
}

}  // namespace

void record(const TensorInfo& rows, const TensorInfo& counter, const TensorListArg& sources,
            const std::optional<TensorInfo>& attribution, const TensorListArg& attribution_sources) {
  auto* count = static_cast<int64_t*>(counter.data);
  const int64_t capacity = rows.size(0);
  // torch.remainder's sign (the divisor's): a negative counter still lands on a row.
  int64_t slot = *count % capacity;
  if (slot < 0) slot += capacity;
  stage(rows, sources, 0);
  if (attribution.has_value()) stage(*attribution, attribution_sources, 1);
  write_row(rows, slot, 0);
  if (attribution.has_value()) write_row(*attribution, slot, 1);
  // Read again after the rows are written, as the composite's add_ reads it; the add wraps as ATen's
  // does at 2^63 (unsigned arithmetic: signed overflow is undefined in C++).
  *count = static_cast<int64_t>(static_cast<uint64_t>(*count) + 1);
}

}  // namespace nanscan::cpu
