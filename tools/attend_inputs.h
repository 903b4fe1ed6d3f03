// Validation of `ringsplash attend`'s command line and input files: every
// check that can be made before any data is read, each failing with one
// message that names the flag or the file.
#ifndef RINGSPLASH_TOOLS_ATTEND_INPUTS_H_
#define RINGSPLASH_TOOLS_ATTEND_INPUTS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "ringsplash/attention.h"
#include "ringsplash/mask.h"
#include "ringsplash/ring.h"
#include "ringsplash/tensor.h"
#include "tools/attend.h"
#include "tools/npy.h"

namespace ringsplash::cli {

enum class Backend { kThreads, kMpi };

// The command line after checking (UsageError on any problem).
struct AttendPlan {
  Layout layout = Layout::kZigzag;
  Backend backend = Backend::kThreads;
  DType dtype = DType::kF32;  // compute dtype of q, k, v, dout
  Mask text_mask;             // --mask, before ANDing a dense mask
  bool backward = false;
};
AttendPlan CheckArgs(const AttendArgs& args);

// Problem sizes read from the headers (SPEC §1).
struct Dims {
  int64_t b = 0, sq = 0, skv = 0, h = 0, hkv = 0, d = 0, dv = 0;
};

// The input files, mapped and checked against each other.
struct AttendFiles {
  npy::NpyArray q, k, v, dout, sinks, q_segments, kv_segments, dense_mask;
  Dims dims;
};
// Opens every given input and checks shapes and dtypes; throws Error naming
// the file on the first problem.
AttendFiles OpenInputs(const AttendArgs& args, const AttendPlan& plan);

// Checks that both sequence lengths split over `ranks` ranks in `layout`.
void CheckDivisible(const AttendFiles& files, Layout layout, int ranks);

// The full mask: --mask AND the dense mask file, if any.
Mask BuildMask(const AttendFiles& files, const AttendPlan& plan);
// The same for one ring rank: only the rows of its query positions `q_rows`
// (Mask::DenseRows), so no rank holds the whole Sq x Skv mask.
Mask BuildMaskRows(const AttendFiles& files, const AttendPlan& plan,
                   const std::vector<int64_t>& q_rows);

// What a run can write. Each output is a [batch, seq, inner] array whose
// rows (dim 1) are the query or the key/value positions — the rows a rank
// owns under MPI — except dsinks, which is global.
enum class OutputKind { kOut, kLse, kDq, kDk, kDv, kDsinks };
enum class RowsOf { kQuery, kKeyValue, kNone };
struct OutputSpec {
  OutputKind kind;
  std::string path;
  std::vector<int64_t> shape;  // as written (f32 .npy)
  RowsOf rows;
  int64_t batch, seq, inner;  // the [batch, seq, inner] view of `shape`
};
std::vector<OutputSpec> PlanOutputs(const AttendArgs& args, const Dims& dims);

}  // namespace ringsplash::cli

#endif  // RINGSPLASH_TOOLS_ATTEND_INPUTS_H_
