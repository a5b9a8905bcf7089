#include "record_cpu.h"

#include <ATen/Dispatch.h>
#include <c10/util/TypeCast.h>

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
#define NANSCAN_RECORD_SOURCE_CASES(...)    \
  AT_DISPATCH_CASE(at::kBool, __VA_ARGS__)  \
  AT_DISPATCH_CASE(at::kByte, __VA_ARGS__)  \
  AT_DISPATCH_CASE(at::kChar, __VA_ARGS__)  \
  AT_DISPATCH_CASE(at::kShort, __VA_ARGS__) \
  AT_DISPATCH_CASE(at::kInt, __VA_ARGS__)   \
  AT_DISPATCH_CASE(at::kLong, __VA_ARGS__)  \
  AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
  AT_DISPATCH_CASE(at::kDouble, __VA_ARGS__)

// One row's values, converted to the row's dtype and held until every source of the call has been
// read. Per thread and kept between calls: an append then allocates nothing.
std::vector<unsigned char>& staging(int which) {
  thread_local std::vector<unsigned char> buffers[2];
  return buffers[which];
}

// Converts every element of `sources`, in order, to Out into `out`. c10::convert is the conversion
// torch's copy_ applies element by element (round to nearest; NaN stays NaN, bool becomes 0 or 1).
template <class Out>
void convert_sources(at::TensorList sources, Out* out) {
  int64_t offset = 0;
  for (const at::Tensor& given : sources) {
    // Read in place when plain; the rare strided view (or a lazily negated one, whose memory holds
    // the values before negation) is made plain first, as copy_ would read it.
    const at::Tensor source = (given.is_contiguous() && !given.is_neg()) ? given : given.resolve_neg().contiguous();
    const int64_t n = source.numel();
    AT_DISPATCH_SWITCH(source.scalar_type(), "nanscan.record_", NANSCAN_RECORD_SOURCE_CASES([&] {
                         const scalar_t* in = source.const_data_ptr<scalar_t>();
                         for (int64_t i = 0; i < n; ++i) out[offset + i] = c10::convert<Out>(in[i]);
                       }));
    offset += n;
  }
}

// `sources` converted to the dtype of `rows` in staging(which): rows.size(1) values.
void stage(const at::Tensor& rows, at::TensorList sources, int which) {
  std::vector<unsigned char>& bytes = staging(which);
  bytes.resize(static_cast<size_t>(rows.size(1)) * rows.element_size());
  if (rows.scalar_type() == at::kFloat) {
    convert_sources(sources, reinterpret_cast<float*>(bytes.data()));
  } else {  // float64, the one other dtype ops.cpp lets rows have
    convert_sources(sources, reinterpret_cast<double*>(bytes.data()));
  }
}

// Copies staging(which) into row `slot` of `rows`, whatever its strides.
void write_row(const at::Tensor& rows, int64_t slot, int which) {
  const std::vector<unsigned char>& bytes = staging(which);
  const int64_t item = rows.element_size();
  unsigned char* row = static_cast<unsigned char*>(rows.data_ptr()) + slot * rows.stride(0) * item;
  if (rows.stride(1) == 1) {
    std::memcpy(row, bytes.data(), bytes.size());
    return;
  }
  for (int64_t j = 0; j < rows.size(1); ++j)
    std::memcpy(row + j * rows.stride(1) * item, bytes.data() + j * item, item);
}

}  // namespace

void record(const at::Tensor& rows, const at::Tensor& counter, at::TensorList sources,
            const std::optional<at::Tensor>& attribution, at::TensorList attribution_sources) {
  int64_t* count = counter.data_ptr<int64_t>();
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
