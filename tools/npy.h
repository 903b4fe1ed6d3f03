// Strict reader and writer of NumPy .npy files (format versions 1.0, 2.0, 3.0).
//
// File layout: magic "\x93NUMPY", major, minor, header length (uint16 LE for
// 1.0, uint32 LE for 2.0/3.0), then a Python dict literal
//   {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
// padded with spaces and ended by '\n', then the raw C-order data.
//
// The reader accepts only what ringsplash uses: little-endian f32/f16/i32/i64,
// bool, u8 and i8, C order, and a file holding exactly the bytes the shape
// needs. Everything else is refused with an Error whose message starts with
// the file's name. Files are memory-mapped, so a rank that copies only its
// shard's rows touches only those pages.
#ifndef RINGSPLASH_TOOLS_NPY_H_
#define RINGSPLASH_TOOLS_NPY_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ringsplash/tensor.h"

namespace ringsplash::npy {

// Element types a .npy file may hold here, by their NumPy descr.
enum class NpyType { kF32, kF16, kI32, kI64, kI8, kU8, kBool };

const char* Descr(NpyType type);  // "<f4", "<f2", "<i4", "<i8", "|i1", "|u1", "|b1"
size_t ItemSize(NpyType type);
bool IsFloat(NpyType type);  // f32, f16
// NpyType of a ringsplash dtype (f32, f16, i32, bool); throws Error for bf16
// (NumPy has no bf16).
NpyType FromDType(DType dtype);

struct NpyHeader {
  int major = 1;
  int minor = 0;
  NpyType type = NpyType::kF32;
  std::vector<int64_t> shape;  // () is a scalar: one element
  size_t data_offset = 0;      // bytes before the data
  int64_t numel() const;
  size_t data_bytes() const { return static_cast<size_t>(numel()) * ItemSize(type); }
};

// Parses the header at the start of `bytes` (the whole file or at least its
// header). `name` prefixes every error message. Does not check the data size.
NpyHeader ParseHeader(std::string_view bytes, const std::string& name);
// The complete header (magic .. '\n') of a version 1.0 file for type/shape,
// padded so the data starts at a multiple of 64 bytes.
std::string FormatHeader(NpyType type, std::span<const int64_t> shape);
// "[4, 16]" for messages.
std::string ShapeString(std::span<const int64_t> shape);

// A read-only memory-mapped .npy file, validated on open.
class NpyArray {
 public:
  // Throws Error naming `path` if it cannot be opened or is not a valid .npy
  // file of a supported type whose size matches its shape.
  static NpyArray Open(const std::string& path);
  NpyArray() = default;
  NpyArray(NpyArray&& other) noexcept;
  NpyArray& operator=(NpyArray&& other) noexcept;
  NpyArray(const NpyArray&) = delete;
  NpyArray& operator=(const NpyArray&) = delete;
  ~NpyArray();

  const std::string& path() const { return path_; }
  const NpyHeader& header() const { return header_; }
  NpyType type() const { return header_.type; }
  const std::vector<int64_t>& shape() const { return header_.shape; }
  int ndim() const { return static_cast<int>(header_.shape.size()); }
  int64_t numel() const { return header_.numel(); }
  const std::byte* data() const { return data_; }

  // Copies the whole array into a new C-order tensor of `dtype`, converting.
  // Float files convert to f32/bf16/f16; integer and bool files to i32 (range
  // checked) or bool (non-zero is true). Other combinations throw Error
  // naming the file and `what` (e.g. "q_segments").
  Tensor Load(DType dtype, const char* what) const;
  // Same for the rows `rows` of dim 1 only (all of dim 0 and trailing dims):
  // the result has shape[1] == rows.size(). Touches only those rows' pages.
  Tensor LoadRows(DType dtype, std::span<const int64_t> rows, const char* what) const;

 private:
  std::string path_;
  NpyHeader header_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const std::byte* data_ = nullptr;
};

// Writes a complete version 1.0 file at `path` (created or truncated).
// `data` holds numel(shape) C-order elements of `type`. Throws Error naming
// the path on any I/O failure.
void WriteNpy(const std::string& path, NpyType type, std::span<const int64_t> shape,
              const void* data);

// An output file whose data is written piecewise at element offsets — by one
// process, or by several ranks each writing its own rows after one of them
// created the file (header written, size set). Closes on destruction.
class NpyOutputFile {
 public:
  // Creates `path` exclusively (it must not exist), writes the header and sets
  // the file size for the whole data (zero-filled). Errors name `name` (e.g.
  // the destination a temporary stands for), or `path` if it is empty.
  static NpyOutputFile Create(const std::string& path, NpyType type, std::vector<int64_t> shape,
                              const std::string& name = "");
  // Opens a file made by Create (by another process) for writing, checking its
  // header matches type/shape.
  static NpyOutputFile OpenExisting(const std::string& path, NpyType type,
                                    std::vector<int64_t> shape);
  NpyOutputFile() = default;
  NpyOutputFile(NpyOutputFile&& other) noexcept;
  NpyOutputFile& operator=(NpyOutputFile&& other) noexcept;
  NpyOutputFile(const NpyOutputFile&) = delete;
  NpyOutputFile& operator=(const NpyOutputFile&) = delete;
  ~NpyOutputFile();

  // Writes `count` elements from `data` starting at element `offset`.
  void Write(int64_t offset, const void* data, int64_t count);
  // Flushes and closes, reporting any deferred I/O error.
  void Close();

 private:
  std::string path_;
  NpyType type_ = NpyType::kF32;
  int64_t numel_ = 0;
  size_t data_offset_ = 0;
  int fd_ = -1;
};

}  // namespace ringsplash::npy

#endif  // RINGSPLASH_TOOLS_NPY_H_
