// CPU backend of record_: one recorder append (nanscan/recorder.py) in one call.
#pragma once

#include <optional>

#include "../torch_api.h"

namespace nanscan::cpu {

// Writes the values of `sources` (flattened, in order, each cast to rows' dtype as torch's copy_
// casts) into row `*counter mod capacity` of `rows` ([capacity, length]), the values of
// `attribution_sources` into the same row of `attribution`, then adds 1 to the counter. Every source
// is read before any row is written, and the counter after, so aliased inputs behave as they do in
// the op's composite implementation. Inputs must have passed record_'s checks (ops.cpp).
void record(const TensorInfo& rows, const TensorInfo& counter, const TensorListArg& sources,
            const std::optional<TensorInfo>& attribution, const TensorListArg& attribution_sources);

}  // namespace nanscan::cpu
