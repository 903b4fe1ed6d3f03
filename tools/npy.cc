// .npy parsing, memory-mapped reading with conversion, and writing.
#include "tools/npy.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <sstream>
#include <utility>

#include "ringsplash/error.h"

namespace ringsplash::npy {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;

std::string ErrnoText() { return std::strerror(errno); }

// A tiny strict parser for the header's Python dict literal. Every failure
// names the file and what was expected at which column.
class HeaderParser {
 public:
  HeaderParser(std::string_view text, const std::string& name) : text_(text), name_(name) {}

  NpyHeader Parse() {
    NpyHeader h;
    bool have_descr = false, have_order = false, have_shape = false;
    SkipSpace();
    Expect('{');
    while (true) {
      SkipSpace();
      if (Peek() == '}') break;
      const std::string key = ParseString("a quoted key");
      SkipSpace();
      Expect(':');
      SkipSpace();
      if (key == "descr") {
        Check(!have_descr, name_, ": header has 'descr' twice");
        have_descr = true;
        h.type = ParseDescr(ParseString("the 'descr' string"));
      } else if (key == "fortran_order") {
        Check(!have_order, name_, ": header has 'fortran_order' twice");
        have_order = true;
        Check(!ParseBool(), name_,
              ": Fortran-order arrays are not supported; save a C-order copy "
              "(np.save(path, np.ascontiguousarray(a)))");
      } else if (key == "shape") {
        Check(!have_shape, name_, ": header has 'shape' twice");
        have_shape = true;
        h.shape = ParseShape();
      } else {
        Fail(name_, ": unexpected key '", key,
             "' in the .npy header (expected descr, fortran_order, shape)");
      }
      SkipSpace();
      if (Peek() == ',') {
        ++pos_;
        continue;
      }
      SkipSpace();
      Check(Peek() == '}', name_, ": malformed .npy header: expected ',' or '}' at column ", pos_);
    }
    Expect('}');
    SkipSpace();
    Check(pos_ == text_.size(), name_, ": malformed .npy header: trailing text after the dict");
    Check(have_descr && have_order && have_shape, name_,
          ": .npy header lacks one of 'descr', 'fortran_order', 'shape'");
    return h;
  }

 private:
  char Peek() const { return pos_ < text_.size() ? text_[pos_] : '\0'; }
  void SkipSpace() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\n' ||
                                   text_[pos_] == '\t' || text_[pos_] == '\r')) {
      ++pos_;
    }
  }
  void Expect(char c) {
    Check(Peek() == c, name_, ": malformed .npy header: expected '", c, "' at column ", pos_);
    ++pos_;
  }
  std::string ParseString(const char* what) {
    const char quote = Peek();
    Check(quote == '\'' || quote == '"', name_, ": malformed .npy header: expected ", what,
          " at column ", pos_);
    ++pos_;
    const size_t end = text_.find(quote, pos_);
    Check(end != std::string_view::npos, name_, ": malformed .npy header: unterminated string");
    std::string s(text_.substr(pos_, end - pos_));
    pos_ = end + 1;
    return s;
  }
  bool ParseBool() {
    if (text_.substr(pos_, 4) == "True") {
      pos_ += 4;
      return true;
    }
    if (text_.substr(pos_, 5) == "False") {
      pos_ += 5;
      return false;
    }
    Fail(name_, ": malformed .npy header: 'fortran_order' must be True or False");
  }
  std::vector<int64_t> ParseShape() {
    std::vector<int64_t> shape;
    bool trailing_comma = false;
    Expect('(');
    while (true) {
      SkipSpace();
      if (Peek() == ')') break;
      Check(Peek() >= '0' && Peek() <= '9', name_,
            ": malformed .npy header: expected a non-negative integer in 'shape' at column ", pos_);
      int64_t v = 0;
      while (Peek() >= '0' && Peek() <= '9') {
        Check(v <= (std::numeric_limits<int64_t>::max() - 9) / 10, name_,
              ": .npy shape dimension too large");
        v = v * 10 + (Peek() - '0');
        ++pos_;
      }
      if (Peek() == 'L') ++pos_;  // Python 2 long suffix
      shape.push_back(v);
      SkipSpace();
      trailing_comma = Peek() == ',';
      if (trailing_comma) {
        ++pos_;
        continue;
      }
      Check(Peek() == ')', name_, ": malformed .npy header: expected ',' or ')' in 'shape'");
    }
    Expect(')');
    // Python writes a 1-tuple as "(5,)"; "(5)" is an int, not a tuple.
    Check(shape.size() != 1 || trailing_comma, name_,
          ": malformed .npy header: 'shape' must be a tuple, e.g. (5,)");
    return shape;
  }
  NpyType ParseDescr(const std::string& d) {
    // One-byte types have no byte order: NumPy writes '|', accept '<' and '=' too.
    if (d.size() == 3 && (d[0] == '|' || d[0] == '<' || d[0] == '=')) {
      const std::string_view t = std::string_view(d).substr(1);
      if (t == "b1") return NpyType::kBool;
      if (t == "u1") return NpyType::kU8;
      if (t == "i1") return NpyType::kI8;
    }
    if (d.size() == 3 && (d[0] == '<' || d[0] == '=')) {
      const std::string_view t = std::string_view(d).substr(1);
      if (t == "f4") return NpyType::kF32;
      if (t == "f2") return NpyType::kF16;
      if (t == "i4") return NpyType::kI32;
      if (t == "i8") return NpyType::kI64;
    }
    if (!d.empty() && d[0] == '>') {
      Fail(name_, ": big-endian data ('", d,
           "') is not supported; save with a little-endian dtype (a.astype('<", d.substr(1), "'))");
    }
    Fail(name_, ": unsupported dtype '", d,
         "'; expected one of '<f4' (float32), '<f2' (float16), '<i4', '<i8', '|b1', '|u1', '|i1'");
  }

  std::string_view text_;
  const std::string& name_;
  size_t pos_ = 0;
};

const char* TypeWord(NpyType t) {
  switch (t) {
    case NpyType::kF32:
      return "float32";
    case NpyType::kF16:
      return "float16";
    case NpyType::kI32:
      return "int32";
    case NpyType::kI64:
      return "int64";
    case NpyType::kI8:
      return "int8";
    case NpyType::kU8:
      return "uint8";
    case NpyType::kBool:
      return "bool";
  }
  return "?";
}

// Reads element i of an integer/bool buffer as int64.
int64_t LoadInt(const std::byte* p, NpyType t, int64_t i) {
  switch (t) {
    case NpyType::kI32: {
      int32_t v;
      std::memcpy(&v, p + i * 4, 4);
      return v;
    }
    case NpyType::kI64: {
      int64_t v;
      std::memcpy(&v, p + i * 8, 8);
      return v;
    }
    case NpyType::kI8:
      return static_cast<int8_t>(p[i]);
    case NpyType::kU8:
    case NpyType::kBool:
      return static_cast<uint8_t>(p[i]);
    case NpyType::kF32:
    case NpyType::kF16:
      break;
  }
  return 0;
}

// "q.npy: value 3.40282e+38 at [0, 0, 0, 5] is out of range for bf16 ...":
// element number `element` (row-major) of the file `name` of `shape`.
[[noreturn]] void FailOutOfRange(const std::string& name, std::span<const int64_t> shape,
                                 int64_t element, float value, DType dtype) {
  std::vector<int64_t> index(shape.size());
  for (size_t i = shape.size(); i-- > 0;) {
    index[i] = element % shape[i];
    element /= shape[i];
  }
  Fail(name, ": value ", value, " at ", ShapeString(index), " is out of range for ",
       DTypeName(dtype), " (overflows to infinity; largest finite ", LargestFinite(dtype),
       "); use --dtype f32");
}

// Converts `count` contiguous elements of file type `src_type` at `src` into
// `dst` (dtype `dst_type`). Callers have checked the combination is allowed.
// The run starts at element `first` of the file `name` of `shape` (for
// messages). A finite float that overflows the narrower dst (f32 beyond the
// bf16/f16 range) is an Error: computing with an infinity the file does not
// hold would silently poison the results. NaN/inf in the file pass through.
void ConvertRun(const std::byte* src, NpyType src_type, void* dst, DType dst_type, int64_t count,
                const std::string& name, std::span<const int64_t> shape, int64_t first) {
  // An empty array's buffers may be null, and memcpy(null, null, 0) is
  // undefined behaviour; there is nothing to convert anyway.
  if (count == 0) return;
  if (IsFloat(src_type)) {
    // A header of odd length leaves the data unaligned; element loads need
    // natural alignment, so such runs go through an aligned copy.
    std::vector<uint32_t> aligned;
    if (reinterpret_cast<uintptr_t>(src) % ItemSize(src_type) != 0) {
      aligned.resize((static_cast<size_t>(count) * ItemSize(src_type) + 3) / 4);
      std::memcpy(aligned.data(), src, static_cast<size_t>(count) * ItemSize(src_type));
      src = reinterpret_cast<const std::byte*>(aligned.data());
    }
    if (src_type == NpyType::kF32 && dst_type == DType::kF32) {
      std::memcpy(dst, src, static_cast<size_t>(count) * 4);
      return;
    }
    const DType sd = src_type == NpyType::kF32 ? DType::kF32 : DType::kF16;
    const TensorView from = TensorView::Contiguous(const_cast<std::byte*>(src), sd, {count});
    const int64_t bad =
        CopyConvertFindOverflow(from, TensorView::Contiguous(dst, dst_type, {count}));
    if (bad >= 0) FailOutOfRange(name, shape, first + bad, LoadAsF32(from, bad), dst_type);
    return;
  }
  if (dst_type == DType::kBool) {
    auto* d = static_cast<uint8_t*>(dst);
    for (int64_t i = 0; i < count; ++i) d[i] = LoadInt(src, src_type, i) != 0;
    return;
  }
  auto* d = static_cast<int32_t*>(dst);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t v = LoadInt(src, src_type, i);
    Check(v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max(),
          name, ": value ", v, " does not fit in int32");
    d[i] = static_cast<int32_t>(v);
  }
}

void CheckConvertible(const NpyArray& a, DType dtype, const char* what) {
  const bool src_float = IsFloat(a.type());
  const bool dst_float = dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16;
  if (dst_float) {
    Check(src_float, a.path(), ": ", what, " must be float32 or float16, got ", TypeWord(a.type()),
          " ('", Descr(a.type()), "')");
  } else {
    Check(!src_float, a.path(), ": ", what, " must be ",
          dtype == DType::kBool ? "bool or integer" : "integer (int32)", ", got ",
          TypeWord(a.type()), " ('", Descr(a.type()), "')");
  }
}

// pwrite all of [data, data + bytes) at `offset`, retrying short writes.
void PwriteAll(int fd, const void* data, size_t bytes, off_t offset, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::pwrite(fd, p, bytes, offset);
    if (n < 0 && errno == EINTR) continue;
    Check(n > 0, path, ": write failed: ", n < 0 ? ErrnoText() : std::string("no progress"));
    p += n;
    bytes -= static_cast<size_t>(n);
    offset += n;
  }
}

}  // namespace

const char* Descr(NpyType type) {
  switch (type) {
    case NpyType::kF32:
      return "<f4";
    case NpyType::kF16:
      return "<f2";
    case NpyType::kI32:
      return "<i4";
    case NpyType::kI64:
      return "<i8";
    case NpyType::kI8:
      return "|i1";
    case NpyType::kU8:
      return "|u1";
    case NpyType::kBool:
      return "|b1";
  }
  return "?";
}

size_t ItemSize(NpyType type) {
  switch (type) {
    case NpyType::kF32:
    case NpyType::kI32:
      return 4;
    case NpyType::kF16:
      return 2;
    case NpyType::kI64:
      return 8;
    case NpyType::kI8:
    case NpyType::kU8:
    case NpyType::kBool:
      return 1;
  }
  return 0;
}

bool IsFloat(NpyType type) { return type == NpyType::kF32 || type == NpyType::kF16; }

NpyType FromDType(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return NpyType::kF32;
    case DType::kF16:
      return NpyType::kF16;
    case DType::kI32:
      return NpyType::kI32;
    case DType::kBool:
      return NpyType::kBool;
    case DType::kBF16:
      break;
  }
  Fail("npy: NumPy has no bf16 type; convert to f32 first");
}

int64_t NpyHeader::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string ShapeString(std::span<const int64_t> shape) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << ']';
  return os.str();
}

NpyHeader ParseHeader(std::string_view bytes, const std::string& name) {
  Check(bytes.size() >= kMagicLen && bytes.substr(0, kMagicLen) == std::string_view(kMagic, 6),
        name, ": not a .npy file (bad magic; expected \\x93NUMPY)");
  Check(bytes.size() >= 10, name, ": truncated .npy header");
  const int major = static_cast<uint8_t>(bytes[6]);
  const int minor = static_cast<uint8_t>(bytes[7]);
  Check((major == 1 || major == 2 || major == 3) && minor == 0, name,
        ": unsupported .npy format version ", major, ".", minor, " (expected 1.0, 2.0 or 3.0)");
  size_t len_bytes = major == 1 ? 2 : 4;
  Check(bytes.size() >= 8 + len_bytes, name, ": truncated .npy header");
  size_t header_len = 0;
  for (size_t i = 0; i < len_bytes; ++i) {
    header_len |= static_cast<size_t>(static_cast<uint8_t>(bytes[8 + i])) << (8 * i);
  }
  const size_t start = 8 + len_bytes;
  Check(bytes.size() >= start + header_len, name, ": truncated .npy header (header claims ",
        header_len, " bytes, file has ", bytes.size() - start, ")");
  NpyHeader h = HeaderParser(bytes.substr(start, header_len), name).Parse();
  h.major = major;
  h.minor = minor;
  h.data_offset = start + header_len;
  // numel * itemsize must fit comfortably in 63 bits — and so must the
  // product of the non-zero dims: an empty array (a 0 dim) is still indexed
  // with partial products of the others (e.g. the row size).
  int64_t nonzero = 1;
  for (int64_t d : h.shape) {
    if (d == 0) continue;
    Check(nonzero <= (int64_t{1} << 56) / d, name, ": shape ", ShapeString(h.shape),
          " is too large");
    nonzero *= d;
  }
  return h;
}

std::string FormatHeader(NpyType type, std::span<const int64_t> shape) {
  std::ostringstream dict;
  dict << "{'descr': '" << Descr(type) << "', 'fortran_order': False, 'shape': (";
  for (size_t i = 0; i < shape.size(); ++i) dict << (i ? ", " : "") << shape[i];
  if (shape.size() == 1) dict << ',';
  dict << "), }";
  std::string body = dict.str();
  // magic(6) + version(2) + length(2) + body + padding + '\n' = multiple of 64.
  const size_t unpadded = 10 + body.size() + 1;
  body.append((64 - unpadded % 64) % 64, ' ');
  body.push_back('\n');
  std::string out(kMagic, kMagicLen);
  out.push_back('\x01');
  out.push_back('\x00');
  out.push_back(static_cast<char>(body.size() & 0xff));
  out.push_back(static_cast<char>(body.size() >> 8));
  return out + body;
}

NpyArray NpyArray::Open(const std::string& path) {
  NpyArray a;
  a.path_ = path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  Check(fd >= 0, path, ": cannot open: ", ErrnoText());
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    Fail(path, ": not a regular file");
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < 10) {
    ::close(fd);
    Fail(path, size >= kMagicLen ? ": truncated .npy header"
                                 : ": not a .npy file (too short for the \\x93NUMPY magic)");
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int saved = errno;
  ::close(fd);
  if (map == MAP_FAILED) {
    errno = saved;
    Fail(path, ": cannot map: ", ErrnoText());
  }
  a.map_ = map;
  a.map_bytes_ = size;
  a.header_ = ParseHeader(std::string_view(static_cast<const char*>(map), size), path);
  const size_t have = size - a.header_.data_offset;
  const size_t need = a.header_.data_bytes();
  Check(have == need, path, ": shape ", ShapeString(a.header_.shape), " of ", Descr(a.header_.type),
        " needs ", need, " data bytes, but the file has ", have,
        have < need ? " (truncated)" : " (trailing bytes)");
  a.data_ = static_cast<const std::byte*>(map) + a.header_.data_offset;
  return a;
}

NpyArray::NpyArray(NpyArray&& o) noexcept
    : path_(std::move(o.path_)),
      header_(std::move(o.header_)),
      map_(std::exchange(o.map_, nullptr)),
      map_bytes_(std::exchange(o.map_bytes_, 0)),
      data_(std::exchange(o.data_, nullptr)) {}

NpyArray& NpyArray::operator=(NpyArray&& o) noexcept {
  if (this != &o) {
    if (map_ != nullptr) ::munmap(map_, map_bytes_);
    path_ = std::move(o.path_);
    header_ = std::move(o.header_);
    map_ = std::exchange(o.map_, nullptr);
    map_bytes_ = std::exchange(o.map_bytes_, 0);
    data_ = std::exchange(o.data_, nullptr);
  }
  return *this;
}

NpyArray::~NpyArray() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

Tensor NpyArray::Load(DType dtype, const char* what) const {
  CheckConvertible(*this, dtype, what);
  Tensor t(dtype, header_.shape);
  ConvertRun(data_, header_.type, t.data(), dtype, numel(), path_, header_.shape, 0);
  return t;
}

Tensor NpyArray::LoadRows(DType dtype, std::span<const int64_t> rows, const char* what) const {
  CheckConvertible(*this, dtype, what);
  Check(ndim() >= 2, path_, ": ", what, " needs at least 2 dims to select rows, got ",
        ShapeString(header_.shape));
  const int64_t batch = header_.shape[0];
  const int64_t seq = header_.shape[1];
  int64_t inner = 1;
  for (int i = 2; i < ndim(); ++i) inner *= header_.shape[i];
  std::vector<int64_t> shape = header_.shape;
  shape[1] = static_cast<int64_t>(rows.size());
  Tensor t(dtype, shape);
  const size_t src_item = ItemSize(header_.type);
  const size_t dst_item = DTypeSize(dtype);
  auto* dst = static_cast<std::byte*>(t.data());
  for (int64_t b = 0; b < batch; ++b) {
    for (size_t i = 0; i < rows.size(); ++i) {
      Check(rows[i] >= 0 && rows[i] < seq, path_, ": row ", rows[i], " out of range [0, ", seq,
            ")");
      const int64_t src_row = b * seq + rows[i];
      const int64_t dst_row = b * static_cast<int64_t>(rows.size()) + static_cast<int64_t>(i);
      ConvertRun(data_ + static_cast<size_t>(src_row * inner) * src_item, header_.type,
                 dst + static_cast<size_t>(dst_row * inner) * dst_item, dtype, inner, path_,
                 header_.shape, src_row * inner);
    }
  }
  return t;
}

void WriteNpy(const std::string& path, NpyType type, std::span<const int64_t> shape,
              const void* data) {
  const std::string header = FormatHeader(type, shape);
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  Check(fd >= 0, path, ": cannot create: ", ErrnoText());
  try {
    PwriteAll(fd, header.data(), header.size(), 0, path);
    PwriteAll(fd, data, static_cast<size_t>(n) * ItemSize(type), static_cast<off_t>(header.size()),
              path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  Check(::close(fd) == 0, path, ": close failed: ", ErrnoText());
}

NpyOutputFile NpyOutputFile::Create(const std::string& path, NpyType type,
                                    std::vector<int64_t> shape, const std::string& name) {
  NpyOutputFile f;
  f.path_ = name.empty() ? path : name;
  f.type_ = type;
  const std::string header = FormatHeader(type, shape);
  f.data_offset_ = header.size();
  f.numel_ = 1;
  for (int64_t d : shape) f.numel_ *= d;
  f.fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  Check(f.fd_ >= 0, f.path_, ": cannot create: ", ErrnoText());
  PwriteAll(f.fd_, header.data(), header.size(), 0, f.path_);
  const off_t total = static_cast<off_t>(f.data_offset_ + f.numel_ * ItemSize(type));
  Check(::ftruncate(f.fd_, total) == 0, f.path_, ": cannot size to ", total,
        " bytes: ", ErrnoText());
  return f;
}

NpyOutputFile NpyOutputFile::OpenExisting(const std::string& path, NpyType type,
                                          std::vector<int64_t> shape) {
  NpyOutputFile f;
  f.path_ = path;
  f.type_ = type;
  const std::string header = FormatHeader(type, shape);
  f.fd_ = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  Check(f.fd_ >= 0, path, ": cannot open for writing: ", ErrnoText());
  std::string have(header.size(), '\0');
  const ssize_t n = ::pread(f.fd_, have.data(), have.size(), 0);
  Check(n == static_cast<ssize_t>(have.size()) && have == header, path,
        ": does not hold the expected header for ", Descr(type), " ", ShapeString(shape));
  f.data_offset_ = header.size();
  f.numel_ = 1;
  for (int64_t d : shape) f.numel_ *= d;
  return f;
}

NpyOutputFile::NpyOutputFile(NpyOutputFile&& o) noexcept
    : path_(std::move(o.path_)),
      type_(o.type_),
      numel_(o.numel_),
      data_offset_(o.data_offset_),
      fd_(std::exchange(o.fd_, -1)) {}

NpyOutputFile& NpyOutputFile::operator=(NpyOutputFile&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(o.path_);
    type_ = o.type_;
    numel_ = o.numel_;
    data_offset_ = o.data_offset_;
    fd_ = std::exchange(o.fd_, -1);
  }
  return *this;
}

NpyOutputFile::~NpyOutputFile() {
  if (fd_ >= 0) ::close(fd_);
}

void NpyOutputFile::Write(int64_t offset, const void* data, int64_t count) {
  Check(fd_ >= 0, path_, ": write to a closed file");
  Check(offset >= 0 && count >= 0 && offset + count <= numel_, path_, ": write of ", count,
        " elements at ", offset, " is outside the array of ", numel_);
  const size_t item = ItemSize(type_);
  PwriteAll(fd_, data, static_cast<size_t>(count) * item,
            static_cast<off_t>(data_offset_ + static_cast<size_t>(offset) * item), path_);
}

void NpyOutputFile::Close() {
  if (fd_ < 0) return;
  const int fd = std::exchange(fd_, -1);
  Check(::close(fd) == 0, path_, ": close failed: ", ErrnoText());
}

}  // namespace ringsplash::npy
