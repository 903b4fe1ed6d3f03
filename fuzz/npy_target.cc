// Fuzz target: the .npy reader (tools/npy.h), on arbitrary file contents.
//
// The input bytes are the whole file. They go through ParseHeader directly
// and through NpyArray::Open on an in-memory file (memfd, so no disk I/O and
// no leftovers), then through every Load conversion and a row selection.
// Properties (anything else aborts):
//   - every rejection is a ringsplash::Error whose message starts with the
//     file's name (the reader's documented contract);
//   - an accepted file's size is exactly header + numel * itemsize;
//   - FormatHeader(type, shape) parses back to the same type and shape;
//   - loads keep numel and the exact values: f32 -> f32 and i32 -> i32 are
//     bit copies of the file's data, LoadRows(rows) equals the same rows of
//     Load();
//   - a written file (WriteNpy) reads back bit-identical.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz/fuzz_targets.h"
#include "fuzz/fuzz_util.h"
#include "ringsplash/error.h"
#include "ringsplash/tensor.h"
#include "tools/npy.h"

namespace ringsplash::fuzz {
namespace {

// Inputs larger than this are skipped: the reader's work is linear in the
// size, and small files reach every branch of the header parser.
constexpr size_t kMaxInput = 1 << 16;

bool StartsWith(std::string_view text, std::string_view prefix) {
  return text.substr(0, prefix.size()) == prefix;
}

// One anonymous in-memory file per process, reopened through /proc so the
// reader sees an ordinary path.
class MemFile {
 public:
  explicit MemFile(const char* name) : fd_(::memfd_create(name, MFD_CLOEXEC)) {
    FuzzCheck(fd_ >= 0, "memfd_create failed");
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  ~MemFile() { ::close(fd_); }
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;

  void Set(const uint8_t* data, size_t size) {
    FuzzCheck(::ftruncate(fd_, 0) == 0, "ftruncate failed");
    size_t done = 0;
    while (done < size) {
      const ssize_t n = ::pwrite(fd_, data + done, size - done, static_cast<off_t>(done));
      FuzzCheck(n > 0, "pwrite to memfd failed");
      done += static_cast<size_t>(n);
    }
  }
  std::vector<uint8_t> Get() const {
    std::vector<uint8_t> bytes(static_cast<size_t>(::lseek(fd_, 0, SEEK_END)));
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n =
          ::pread(fd_, bytes.data() + done, bytes.size() - done, static_cast<off_t>(done));
      FuzzCheck(n > 0, "pread from memfd failed");
      done += static_cast<size_t>(n);
    }
    return bytes;
  }
  const std::string& path() const { return path_; }

 private:
  int fd_;
  std::string path_;
};

void CheckHeaderParser(std::string_view bytes) {
  const std::string name = "fuzz.npy";
  npy::NpyHeader h;
  try {
    h = npy::ParseHeader(bytes, name);
  } catch (const Error& e) {
    FuzzCheck(StartsWith(e.what(), name), "ParseHeader error does not name the file: ", e.what());
    return;
  }
  FuzzCheck(h.data_offset <= bytes.size(), "ParseHeader: data offset ", h.data_offset,
            " beyond the ", bytes.size(), " input bytes");
  for (int64_t d : h.shape) FuzzCheck(d >= 0, "ParseHeader accepted a negative dimension");
  const std::string formatted = npy::FormatHeader(h.type, h.shape);
  const npy::NpyHeader back = npy::ParseHeader(formatted, "formatted");
  FuzzCheck(back.type == h.type && back.shape == h.shape,
            "FormatHeader does not parse back to its type and shape: ", formatted);
  FuzzCheck(back.data_offset == formatted.size() && formatted.size() % 64 == 0,
            "FormatHeader: data must start right after a 64-byte aligned header");
}

// Bytes of the file's data as the reader mapped it.
std::vector<uint8_t> RawData(const npy::NpyArray& a) {
  const auto* p = reinterpret_cast<const uint8_t*>(a.data());
  return std::vector<uint8_t>(p, p + a.header().data_bytes());
}

void CheckLoads(const npy::NpyArray& a, MemFile& scratch) {
  const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kF16, DType::kI32, DType::kBool};
  const std::vector<uint8_t> raw = RawData(a);
  for (DType dt : dtypes) {
    Tensor t;
    try {
      t = a.Load(dt, "fuzzed array");
    } catch (const Error& e) {
      FuzzCheck(StartsWith(e.what(), a.path()), "Load error does not name the file: ", e.what());
      continue;
    }
    FuzzCheck(t.numel() == a.numel(), "Load(", DTypeName(dt), ") changed numel");
    FuzzCheck(t.shape() == a.shape(), "Load(", DTypeName(dt), ") changed the shape");
    const bool bit_copy = (dt == DType::kF32 && a.type() == npy::NpyType::kF32) ||
                          (dt == DType::kI32 && a.type() == npy::NpyType::kI32);
    if (bit_copy && !raw.empty()) {
      FuzzCheck(std::memcmp(t.data(), raw.data(), raw.size()) == 0, "Load(", DTypeName(dt),
                ") did not copy the file's values exactly");
    }
    if (dt == DType::kBool) {
      const auto* b = t.data_as<uint8_t>();
      for (int64_t i = 0; i < t.numel(); ++i) FuzzCheck(b[i] <= 1, "Load(bool) produced ", b[i]);
    }

    // LoadRows: the first and last row of dim 1, and an out-of-range row.
    // (Its work is O(dim 0) even for an empty array: capped so that a
    // shape like (10^6, 5, 0) does not make one input take seconds.)
    if (a.ndim() >= 2 && a.shape()[1] > 0 && a.shape()[0] <= 4096) {
      const int64_t seq = a.shape()[1];
      const std::vector<int64_t> rows = {seq - 1, 0};
      const Tensor sel = a.LoadRows(dt, rows, "fuzzed rows");
      FuzzCheck(sel.shape()[1] == 2, "LoadRows returned ", sel.shape()[1], " rows, expected 2");
      const int64_t batch = a.shape()[0];
      const int64_t inner = seq == 0 || batch == 0 ? 0 : a.numel() / (batch * seq);
      const size_t item = DTypeSize(dt);
      const auto* full = static_cast<const uint8_t*>(t.data());
      const auto* part = static_cast<const uint8_t*>(sel.data());
      for (int64_t b = 0; b < batch; ++b) {
        for (int64_t i = 0; i < 2; ++i) {
          const size_t n = static_cast<size_t>(inner) * item;
          FuzzCheck(std::memcmp(part + static_cast<size_t>(b * 2 + i) * n,
                                full + static_cast<size_t>(b * seq + rows[i]) * n, n) == 0,
                    "LoadRows row ", rows[i], " of batch ", b, " differs from Load()");
        }
      }
      const std::vector<int64_t> bad = {seq};
      try {
        a.LoadRows(dt, bad, "fuzzed rows");
        FuzzCheck(batch == 0, "LoadRows accepted row ", seq, " of a dim of size ", seq);
      } catch (const Error& e) {
        FuzzCheck(StartsWith(e.what(), a.path()), "LoadRows error does not name the file");
      }
    }
  }

  // Writer round trip for the types the writer supports, small files only.
  if (a.numel() <= 4096) {
    npy::WriteNpy(scratch.path(), a.type(), a.shape(), a.data());
    const npy::NpyArray back = npy::NpyArray::Open(scratch.path());
    FuzzCheck(back.type() == a.type() && back.shape() == a.shape(),
              "WriteNpy + Open changed type or shape");
    FuzzCheck(RawData(back) == raw, "WriteNpy + Open changed the data");
  }
}

}  // namespace

int NpyOneInput(const uint8_t* data, size_t size) {
  if (size > kMaxInput) return 0;
  static MemFile file("npy_fuzz_input");
  static MemFile scratch("npy_fuzz_scratch");
  CheckHeaderParser(std::string_view(reinterpret_cast<const char*>(data), size));

  file.Set(data, size);
  npy::NpyArray a;
  try {
    a = npy::NpyArray::Open(file.path());
  } catch (const Error& e) {
    FuzzCheck(StartsWith(e.what(), file.path()), "Open error does not name the file: ", e.what());
    return 0;
  }
  FuzzCheck(a.header().data_offset + a.header().data_bytes() == size, "Open accepted ", size,
            " bytes for a header of ", a.header().data_offset, " and data of ",
            a.header().data_bytes());
  CheckLoads(a, scratch);
  return 0;
}

}  // namespace ringsplash::fuzz
