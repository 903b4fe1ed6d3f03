// Do the ranks of a ring call agree on its collective arguments?
//
// Every rank derives global facts from its OWN view (global length = local
// length x N, the mask, the scale, ...), so ranks that were handed different
// arguments would otherwise compute silently wrong results or fail late and
// oddly. Each rank reduces the arguments every rank must share to a fixed
// list of 64-bit fields (Field below; the mask and the sinks values enter as
// hashes) and the ranks compare them with the Communicator's only collective,
// AllReduceSum:
//   1. digest  [64] floats: bit i of a 64-bit hash of the field list, as
//      0 or 1. Summed, each element counts the ranks whose bit i is set;
//      the ranks agree iff every count is 0 or N. The common case costs this
//      one collective of 64 floats, whatever N.
//   2. fields  [N, kNumFields * 4] floats (only on a mismatch): every rank's
//      fields in its own slot, to name the lowest rank r that differs from
//      rank 0 and the first field that differs.
//   3. details [2, L] floats (only for the mask and the sinks values, which
//      are hashes in step 2): rank 0's and rank r's mask text or sinks.
// Exactness: the sums are integers below 2^24 (bit counts up to N; in steps
// 2 and 3 16-bit pieces or bytes with one non-zero addend per element), so
// they are exact floats on every backend. Every rank therefore sees the same
// numbers, takes the same branches (same collectives) and throws the same
// message.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "ringsplash/error.h"
#include "src/mask/mask_node.h"
#include "src/ring/ring_internal.h"

namespace ringsplash::ring_internal {

namespace {

// Ordered by how fundamental a difference is: the first differing field is
// the one reported. kHeads precedes kSinksHash (the sinks exchange in step 3
// sizes its buffer by H, which must then agree).
enum Field : int {
  kBackward,
  kDType,
  kBatch,
  kSq,
  kSkv,
  kHeads,
  kKvHeads,
  kHeadDim,
  kValueDim,
  kLayout,
  kHasSegments,
  kHasSinks,
  kSinksHash,
  kMaskHash,
  kScale,
  kSoftcap,
  kBlockQ,
  kBlockKv,
  kNumFields
};

constexpr int kPieces = 4;  // 16-bit pieces per 64-bit value
constexpr size_t kMaxMaskText = 200;

using Fields = std::vector<uint64_t>;

// splitmix64's finaliser: a cheap, well-mixing 64-bit permutation.
uint64_t Mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

class Hasher {
 public:
  void Add(uint64_t x) { h_ = Mix(h_ ^ Mix(x + 0x9e3779b97f4a7c15ULL)); }
  // Eight bytes at a time: dense masks can be large.
  void AddBytes(const void* data, size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      uint64_t w;
      std::memcpy(&w, p + i, 8);
      Add(w);
    }
    uint64_t tail = 0;
    if (n > i) std::memcpy(&tail, p + i, n - i);
    Add(tail);
    Add(n);
  }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 0x243f6a8885a308d3ULL;
};

uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The bytes of every Dense leaf (values are normalised to 0/1 at
// construction, so equal masks have equal bytes).
// Leaves of Mask::DenseRows hold each rank's OWN rows, which differ by rank
// by design: only their shape (in the text) is compared.
void HashDenseLeaves(const mask_detail::Node& node, Hasher& h) {
  if (node.kind == mask_detail::NodeKind::kDense && node.row_pos.empty())
    h.AddBytes(node.values.data(), node.values.size());
  for (const auto& child : node.children) HashDenseLeaves(*child, h);
}

uint64_t MaskHash(const Mask& mask) {
  Hasher h;
  const std::string text = mask.ToString();
  h.AddBytes(text.data(), text.size());
  if (mask.has_dense()) HashDenseLeaves(mask.node(), h);
  return h.value();
}

// sinks [H] f32 (validated), any stride.
std::vector<float> SinksValues(const TensorView& sinks) {
  std::vector<float> values;
  if (!sinks.defined()) return values;
  for (int64_t i = 0; i < sinks.shape[0]; ++i)
    values.push_back(LoadAsF32(sinks, i * sinks.stride[0]));
  return values;
}

Fields LocalFields(const AttentionInputs& local, const RingOptions& options,
                   const kernels::AttentionDims& d, float scale, bool backward) {
  const AttentionOptions& opt = options.attention;
  Fields f(kNumFields, 0);
  f[kBackward] = backward ? 1 : 0;
  f[kDType] = static_cast<uint64_t>(local.q.dtype);
  f[kBatch] = static_cast<uint64_t>(d.b);
  f[kSq] = static_cast<uint64_t>(d.sq);
  f[kSkv] = static_cast<uint64_t>(d.skv);
  f[kHeads] = static_cast<uint64_t>(d.h);
  f[kKvHeads] = static_cast<uint64_t>(d.hkv);
  f[kHeadDim] = static_cast<uint64_t>(d.d);
  f[kValueDim] = static_cast<uint64_t>(d.dv);
  f[kLayout] = static_cast<uint64_t>(options.layout);
  f[kHasSegments] = local.q_segments.defined() ? 1 : 0;
  f[kHasSinks] = local.sinks.defined() ? 1 : 0;
  if (local.sinks.defined()) {
    Hasher h;
    for (float s : SinksValues(local.sinks)) h.Add(FloatBits(s));
    f[kSinksHash] = h.value();
  }
  f[kMaskHash] = MaskHash(opt.mask);
  f[kScale] = FloatBits(scale);
  // Bit 32 marks "set": no soft cap differs from every cap value.
  f[kSoftcap] = opt.softcap ? (uint64_t{1} << 32) | FloatBits(*opt.softcap) : 0;
  f[kBlockQ] = static_cast<uint64_t>(opt.block_sizes.q);
  f[kBlockKv] = static_cast<uint64_t>(opt.block_sizes.kv);
  return f;
}

void PutPieces(uint64_t value, float* dst) {
  for (int i = 0; i < kPieces; ++i) dst[i] = static_cast<float>((value >> (16 * i)) & 0xffff);
}

uint64_t GetPieces(const float* src) {
  uint64_t value = 0;
  for (int i = 0; i < kPieces; ++i) value |= static_cast<uint64_t>(src[i]) << (16 * i);
  return value;
}

// All-reduces [N, width] slots in which this rank fills slot `rank` with
// `mine` (width 64-bit values); returns every rank's values.
std::vector<Fields> GatherFields(Communicator& comm, const Fields& mine) {
  const size_t n = static_cast<size_t>(comm.size());
  const size_t width = mine.size();
  std::vector<float> buf(n * width * kPieces, 0.0f);
  float* slot = buf.data() + static_cast<size_t>(comm.rank()) * width * kPieces;
  for (size_t i = 0; i < width; ++i) PutPieces(mine[i], slot + i * kPieces);
  comm.AllReduceSum(buf.data(), buf.size());
  std::vector<Fields> all(n, Fields(width));
  for (size_t r = 0; r < n; ++r) {
    for (size_t i = 0; i < width; ++i)
      all[r][i] = GetPieces(buf.data() + (r * width + i) * kPieces);
  }
  return all;
}

// Step 3: rank 0 and rank `other` each contribute `len` bytes; returns both.
// Every rank calls it with the same `len`.
struct BytePair {
  std::vector<uint8_t> zero, other;
};
BytePair ExchangeBytes(Communicator& comm, int other, const std::vector<uint8_t>& mine,
                       size_t len) {
  std::vector<float> buf(2 * len, 0.0f);
  const int me = comm.rank();
  if (me == 0 || me == other) {
    float* dst = buf.data() + (me == 0 ? 0 : len);
    for (size_t i = 0; i < len && i < mine.size(); ++i) dst[i] = mine[i];
  }
  comm.AllReduceSum(buf.data(), buf.size());
  BytePair pair{std::vector<uint8_t>(len), std::vector<uint8_t>(len)};
  for (size_t i = 0; i < len; ++i) {
    pair.zero[i] = static_cast<uint8_t>(buf[i]);
    pair.other[i] = static_cast<uint8_t>(buf[len + i]);
  }
  return pair;
}

std::string MaskText(const Mask& mask) {
  std::string text = mask.ToString();
  if (text.size() > kMaxMaskText) text = text.substr(0, kMaxMaskText - 3) + "...";
  return text;
}

std::string TextOf(const std::vector<uint8_t>& bytes) {
  std::string s;
  for (uint8_t c : bytes) {
    if (c == 0) break;
    s += static_cast<char>(c);
  }
  return s;
}

// Shortest of 6 or 9 significant digits that reads back as `f`.
std::string FormatFloat(float f) {
  for (int digits : {6, 9}) {
    std::ostringstream os;
    os.precision(digits);
    os << f;
    if (std::strtof(os.str().c_str(), nullptr) == f || digits == 9) return os.str();
  }
  return {};
}

const char* LayoutText(uint64_t v) {
  switch (v) {
    case static_cast<uint64_t>(Layout::kContiguous):
      return LayoutName(Layout::kContiguous);
    case static_cast<uint64_t>(Layout::kZigzag):
      return LayoutName(Layout::kZigzag);
    default:
      return LayoutName(Layout::kStriped);
  }
}

std::string SoftcapText(uint64_t v) {
  if (v == 0) return "none";
  return FormatFloat(BitsFloat(static_cast<uint32_t>(v)));
}

template <typename... Args>
std::string Str(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

// The message for a field whose value says everything:
// "ring: rank R passed <what> <theirs> but rank 0 passed <ours>".
std::string FieldMessage(Field f, int r, uint64_t ours, uint64_t theirs) {
  const std::string who = "ring: rank " + std::to_string(r) + " ";
  const std::string a = std::to_string(theirs), b = std::to_string(ours);
  auto passed = [&](const char* what, const std::string& x, const std::string& y) {
    return Str(who, "passed ", what, x, " but rank 0 passed ", y);
  };
  auto uses = [&](const char* what, const std::string& x, const std::string& y) {
    return Str(who, "uses ", what, x, " but rank 0 uses ", what, y);
  };
  auto has = [&](const char* what) {
    return theirs != 0 ? Str(who, "passed ", what, " but rank 0 passed none")
                       : Str(who, "passed no ", what, " but rank 0 passed them");
  };
  switch (f) {
    case kBackward:
      return Str(who, "called RingAttention", theirs ? "Backward" : "Forward",
                 " but rank 0 called RingAttention", ours ? "Backward" : "Forward");
    case kDType:
      return passed("q/k/v in ", DTypeName(static_cast<DType>(theirs)),
                    DTypeName(static_cast<DType>(ours)));
    case kBatch:
      return passed("q with batch size ", a, b);
    case kSq:
      return passed("q with ", a + " local rows", b);
    case kSkv:
      return passed("k/v with ", a + " local rows", b);
    case kHeads:
      return passed("q with ", a + " heads (H)", b);
    case kKvHeads:
      return passed("k/v with ", a + " heads (Hkv)", b);
    case kHeadDim:
      return passed("q/k with head dim D=", a, b);
    case kValueDim:
      return passed("v with head dim Dv=", a, b);
    case kLayout:
      return Str(who, "uses layout '", LayoutText(theirs), "' but rank 0 uses '", LayoutText(ours),
                 "'");
    case kHasSegments:
      return has("segment ids");
    case kHasSinks:
      return has("sinks");
    case kScale:
      return uses("scale ", FormatFloat(BitsFloat(static_cast<uint32_t>(theirs))),
                  FormatFloat(BitsFloat(static_cast<uint32_t>(ours))));
    case kSoftcap:
      return uses("softcap ", SoftcapText(theirs), SoftcapText(ours));
    case kBlockQ:
      return uses("block_sizes.q=", a, b);
    case kBlockKv:
      return uses("block_sizes.kv=", a, b);
    default:
      return Str(who, "passed different collective arguments than rank 0 (field ",
                 static_cast<int>(f), ")");
  }
}

// Collective (step 3): every rank calls it when the mask hashes differ.
std::string MaskMessage(Communicator& comm, int r, const Mask& mask) {
  const std::string mine = MaskText(mask);
  const BytePair texts =
      ExchangeBytes(comm, r, std::vector<uint8_t>(mine.begin(), mine.end()), kMaxMaskText);
  const std::string zero = TextOf(texts.zero), other = TextOf(texts.other);
  if (zero != other) {
    return Str("ring: ranks disagree on the mask (rank 0: '", zero, "', rank ", r, ": '", other,
               "')");
  }
  return Str("ring: ranks disagree on the dense mask values (rank 0 and rank ", r, " both pass '",
             zero, "' but with different contents)");
}

// Collective (step 3): every rank calls it when the sinks hashes differ
// (H agrees by then: kHeads comes first).
std::string SinksMessage(Communicator& comm, int r, const TensorView& sinks, int64_t heads) {
  std::vector<uint8_t> mine;
  for (float s : SinksValues(sinks)) {
    const uint32_t u = FloatBits(s);
    for (int i = 0; i < 4; ++i) mine.push_back(static_cast<uint8_t>(u >> (8 * i)));
  }
  const BytePair both = ExchangeBytes(comm, r, mine, static_cast<size_t>(heads) * 4);
  for (int64_t h = 0; h < heads; ++h) {
    uint32_t u0 = 0, ur = 0;
    for (int i = 0; i < 4; ++i) {
      const auto at = static_cast<size_t>(h * 4 + i);
      u0 |= static_cast<uint32_t>(both.zero[at]) << (8 * i);
      ur |= static_cast<uint32_t>(both.other[at]) << (8 * i);
    }
    if (u0 != ur) {
      return Str("ring: ranks disagree on sinks[", h, "] (rank 0: ", FormatFloat(BitsFloat(u0)),
                 ", rank ", r, ": ", FormatFloat(BitsFloat(ur)), ")");
    }
  }
  return Str("ring: ranks disagree on the sinks values (rank 0 and rank ", r, ")");
}

// The message for the first field in which some rank differs from rank 0
// (collective: may run step 3).
std::string DisagreementMessage(Communicator& comm, const std::vector<Fields>& all,
                                const AttentionInputs& local, const RingOptions& options,
                                int64_t heads) {
  for (size_t r = 1; r < all.size(); ++r) {
    for (int f = 0; f < kNumFields; ++f) {
      const uint64_t ours = all[0][static_cast<size_t>(f)];
      const uint64_t theirs = all[r][static_cast<size_t>(f)];
      if (ours == theirs) continue;
      const int rank = static_cast<int>(r);
      if (f == kMaskHash) return MaskMessage(comm, rank, options.attention.mask);
      if (f == kSinksHash) return SinksMessage(comm, rank, local.sinks, heads);
      return FieldMessage(static_cast<Field>(f), rank, ours, theirs);
    }
  }
  // Not reached: different digests come from different fields.
  return "ring: ranks disagree on their collective arguments";
}

}  // namespace

void CheckRanksAgree(Communicator& comm, const AttentionInputs& local, const RingOptions& options,
                     const kernels::AttentionDims& dims, float scale, bool backward) {
  if (comm.size() <= 1) return;
  const Fields mine = LocalFields(local, options, dims, scale, backward);
  Hasher digest;
  for (uint64_t v : mine) digest.Add(v);
  std::vector<float> bits(64);
  for (size_t i = 0; i < bits.size(); ++i) bits[i] = static_cast<float>((digest.value() >> i) & 1);
  comm.AllReduceSum(bits.data(), bits.size());
  const auto n = static_cast<float>(comm.size());
  bool agree = true;
  for (float count : bits) agree = agree && (count == 0.0f || count == n);
  if (agree) return;

  const std::vector<Fields> all = GatherFields(comm, mine);
  throw RanksDisagree(DisagreementMessage(comm, all, local, options, dims.h));
}

}  // namespace ringsplash::ring_internal
