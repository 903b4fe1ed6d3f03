// The strict .npy reader and the writer (tools/npy.h). Files are built here
// byte by byte, independently of the writer under test.
#include "tools/npy.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "ringsplash/error.h"
#include "tests/cli/cli_test_util.h"

namespace ringsplash::npy {
namespace {

using ringsplash::testing::ScratchDir;

// A .npy file: magic, version, little-endian header length (2 bytes for
// 1.0, 4 for 2.0/3.0), the dict text padded to a 64-byte boundary when
// `pad`, '\n', then `data`.
std::string NpyBytes(int major, const std::string& dict, const std::string& data, bool pad = true) {
  std::string body = dict;
  const size_t len_bytes = major == 1 ? 2 : 4;
  if (pad) {
    const size_t unpadded = 8 + len_bytes + body.size() + 1;
    body.append((64 - unpadded % 64) % 64, ' ');
  }
  body += '\n';
  std::string out = "\x93NUMPY";
  out += static_cast<char>(major);
  out += '\0';
  for (size_t i = 0; i < len_bytes; ++i) out += static_cast<char>((body.size() >> (8 * i)) & 0xff);
  return out + body + data;
}

std::string Dict(const std::string& descr, const std::string& shape) {
  return "{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
}

template <typename T>
std::string Raw(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

std::string WriteFile(const ScratchDir& dir, const std::string& name, const std::string& bytes) {
  const std::string path = dir / name;
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

std::vector<float> AsFloats(const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < v.size(); ++i) v[i] = LoadAsF32(t.view(), static_cast<int64_t>(i));
  return v;
}

class NpyVersionTest : public ::testing::TestWithParam<int> {};

TEST_P(NpyVersionTest, ReadsFloat32) {
  ScratchDir dir;
  const std::vector<float> v = {1.5f, -2.0f, 0.25f, 0.375f, 7.0f, -0.0f};
  const std::string path =
      WriteFile(dir, "a.npy", NpyBytes(GetParam(), Dict("<f4", "(2, 3)"), Raw(v)));
  const NpyArray a = NpyArray::Open(path);
  EXPECT_EQ(a.header().major, GetParam());
  EXPECT_EQ(a.type(), NpyType::kF32);
  EXPECT_EQ(a.shape(), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(AsFloats(a.Load(DType::kF32, "x")), v);
  // To bf16: every value here is exactly representable in bf16.
  EXPECT_EQ(AsFloats(a.Load(DType::kBF16, "x")), v);
}

TEST_P(NpyVersionTest, ReadsFloat16) {
  ScratchDir dir;
  // IEEE half bit patterns: 1.0, -2.0, 0.5, 65504 (max), 2^-24 (min subnormal).
  const std::vector<uint16_t> h = {0x3c00, 0xc000, 0x3800, 0x7bff, 0x0001};
  const std::string path =
      WriteFile(dir, "h.npy", NpyBytes(GetParam(), Dict("<f2", "(5,)"), Raw(h)));
  const NpyArray a = NpyArray::Open(path);
  EXPECT_EQ(a.type(), NpyType::kF16);
  EXPECT_EQ(AsFloats(a.Load(DType::kF32, "x")),
            (std::vector<float>{1.0f, -2.0f, 0.5f, 65504.0f, 5.9604644775390625e-8f}));
}

TEST_P(NpyVersionTest, ReadsIntegersAndBools) {
  ScratchDir dir;
  const int major = GetParam();
  const std::vector<int32_t> i4 = {0, -7, 123456789, 2};
  const std::vector<int64_t> i8 = {0, -7, 2147483647, 2};
  const std::vector<uint8_t> b1 = {0, 1, 1, 0};
  const std::vector<uint8_t> u1 = {0, 255, 3, 0};
  const std::vector<int8_t> s1 = {0, -1, 5, 0};
  struct Case {
    const char* descr;
    std::string data;
    std::vector<int32_t> as_i32;
  } cases[] = {
      {"<i4", Raw(i4), i4},
      {"<i8", Raw(i8), {0, -7, 2147483647, 2}},
      {"|b1", Raw(b1), {0, 1, 1, 0}},
      {"|u1", Raw(u1), {0, 255, 3, 0}},
      {"|i1", Raw(s1), {0, -1, 5, 0}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.descr);
    const std::string path =
        WriteFile(dir, "i.npy", NpyBytes(major, Dict(c.descr, "(2, 2)"), c.data));
    const NpyArray a = NpyArray::Open(path);
    const Tensor t = a.Load(DType::kI32, "ids");
    EXPECT_EQ(std::vector<int32_t>(t.data_as<int32_t>(), t.data_as<int32_t>() + 4), c.as_i32);
    const Tensor m = a.Load(DType::kBool, "mask");
    for (int i = 0; i < 4; ++i) EXPECT_EQ(m.data_as<uint8_t>()[i], c.as_i32[i] != 0 ? 1 : 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Versions, NpyVersionTest, ::testing::Values(1, 2, 3));

TEST(Npy, AcceptsHeaderVariantsNumpyMayWrite) {
  ScratchDir dir;
  const std::vector<float> v = {1, 2};
  // Double quotes, other key order, no trailing comma, extra spaces, '=' order, no padding.
  const std::string dicts[] = {
      "{\"descr\": \"<f4\", \"fortran_order\": False, \"shape\": (2,)}",
      "{'shape': (2,), 'fortran_order': False, 'descr': '<f4'}",
      "{ 'descr' : '=f4' , 'fortran_order' : False , 'shape' : ( 2 , ) , }",
      "{'descr': '<f4', 'fortran_order': False, 'shape': (2L,), }",
  };
  for (const std::string& d : dicts) {
    SCOPED_TRACE(d);
    const std::string path = WriteFile(dir, "v.npy", NpyBytes(1, d, Raw(v), /*pad=*/false));
    const NpyArray a = NpyArray::Open(path);
    EXPECT_EQ(a.shape(), (std::vector<int64_t>{2}));
    EXPECT_EQ(AsFloats(a.Load(DType::kF32, "x")), v);
  }
}

TEST(Npy, ScalarAndEmptyShapes) {
  ScratchDir dir;
  const NpyArray s = NpyArray::Open(
      WriteFile(dir, "s.npy", NpyBytes(1, Dict("<f4", "()"), Raw(std::vector<float>{4.0f}))));
  EXPECT_TRUE(s.shape().empty());
  EXPECT_EQ(s.numel(), 1);
  const NpyArray e =
      NpyArray::Open(WriteFile(dir, "e.npy", NpyBytes(1, Dict("<f4", "(0, 3)"), "")));
  EXPECT_EQ(e.shape(), (std::vector<int64_t>{0, 3}));
  EXPECT_EQ(e.numel(), 0);
}

TEST(Npy, UnalignedDataStillLoads) {
  ScratchDir dir;
  // Unpadded header of odd length: the float data starts at an odd offset.
  const std::string dict = Dict("<f4", "(3,)") + " ";
  const std::vector<float> v = {0.5f, -1.25f, 8.0f};
  const std::string bytes = NpyBytes(1, dict, Raw(v), /*pad=*/false);
  ASSERT_NE((bytes.size() - 12) % 4, 0u);
  const NpyArray a = NpyArray::Open(WriteFile(dir, "u.npy", bytes));
  EXPECT_EQ(AsFloats(a.Load(DType::kF32, "x")), v);
}

TEST(Npy, LoadRowsCopiesOnlyTheGivenRowsOfEveryBatch) {
  ScratchDir dir;
  // [B=2, S=4, 3] with value 100*b + 10*s + e.
  std::vector<float> v;
  for (int b = 0; b < 2; ++b)
    for (int s = 0; s < 4; ++s)
      for (int e = 0; e < 3; ++e) v.push_back(static_cast<float>(100 * b + 10 * s + e));
  const NpyArray a =
      NpyArray::Open(WriteFile(dir, "r.npy", NpyBytes(1, Dict("<f4", "(2, 4, 3)"), Raw(v))));
  const std::vector<int64_t> rows = {1, 3};
  const Tensor t = a.LoadRows(DType::kF32, rows, "x");
  EXPECT_EQ(t.shape(), (std::vector<int64_t>{2, 2, 3}));
  std::vector<float> want;
  for (int b = 0; b < 2; ++b)
    for (int64_t s : rows)
      for (int e = 0; e < 3; ++e) want.push_back(static_cast<float>(100 * b + 10 * s + e));
  EXPECT_EQ(AsFloats(t), want);
}

TEST(Npy, WriterRoundTripsAndAlignsData) {
  ScratchDir dir;
  const std::vector<float> f = {1, -2, 3.5f, 4, 5, 6};
  const std::vector<int64_t> shape = {3, 2};
  WriteNpy(dir / "w.npy", NpyType::kF32, shape, f.data());
  const NpyArray a = NpyArray::Open(dir / "w.npy");
  EXPECT_EQ(a.header().major, 1);
  EXPECT_EQ(a.header().data_offset % 64, 0u);
  EXPECT_EQ(a.shape(), shape);
  EXPECT_EQ(AsFloats(a.Load(DType::kF32, "x")), f);

  const std::vector<int32_t> i = {7, -8, 9};
  const std::vector<int64_t> ishape = {3};
  WriteNpy(dir / "i.npy", NpyType::kI32, ishape, i.data());
  const Tensor ti = NpyArray::Open(dir / "i.npy").Load(DType::kI32, "ids");
  EXPECT_EQ(std::vector<int32_t>(ti.data_as<int32_t>(), ti.data_as<int32_t>() + 3), i);

  const std::vector<uint8_t> b = {1, 0, 1, 1};
  const std::vector<int64_t> bshape = {2, 2};
  WriteNpy(dir / "b.npy", NpyType::kBool, bshape, b.data());
  const NpyArray ab = NpyArray::Open(dir / "b.npy");
  EXPECT_EQ(ab.type(), NpyType::kBool);
  // The writer's header is what NumPy writes: the dict, space padding to a
  // 64-byte boundary, '\n'.
  const std::string header = FormatHeader(NpyType::kF32, shape);
  EXPECT_EQ(header.find("{'descr': '<f4', 'fortran_order': False, 'shape': (3, 2), }"), 10u);
  EXPECT_EQ(header.size() % 64, 0u);
  EXPECT_EQ(header.back(), '\n');
}

TEST(Npy, OutputFileWritesPiecesAndRefusesToClobber) {
  ScratchDir dir;
  const std::string path = dir / "o.npy";
  {
    NpyOutputFile f = NpyOutputFile::Create(path, NpyType::kF32, {2, 2});
    const float hi[2] = {3, 4};
    f.Write(2, hi, 2);
    f.Close();
  }
  {
    NpyOutputFile g = NpyOutputFile::OpenExisting(path, NpyType::kF32, {2, 2});
    const float lo[2] = {1, 2};
    g.Write(0, lo, 2);
    EXPECT_THROW(g.Write(3, lo, 2), Error);  // past the end
    g.Close();
  }
  EXPECT_EQ(AsFloats(NpyArray::Open(path).Load(DType::kF32, "x")),
            (std::vector<float>{1, 2, 3, 4}));
  EXPECT_THROW(NpyOutputFile::Create(path, NpyType::kF32, {2, 2}), Error);
  EXPECT_THROW(NpyOutputFile::OpenExisting(path, NpyType::kF32, {4}), Error);
}

// Every malformed file is refused with an Error whose message starts with
// the file's path and says what is wrong.
struct BadFile {
  const char* name;
  std::string bytes;
  const char* message;
};

std::vector<BadFile> BadFiles() {
  const std::string six = Raw(std::vector<float>(6, 1.0f));
  std::string wrong_magic = NpyBytes(1, Dict("<f4", "(2, 3)"), six);
  wrong_magic[1] = 'M';
  std::string huge_len = NpyBytes(1, Dict("<f4", "(2, 3)"), six);
  huge_len[8] = '\xff';
  huge_len[9] = '\xff';
  return {
      {"bad_magic", wrong_magic, "bad magic"},
      {"empty", "", "not a .npy file"},
      {"tiny", "\x93NUM", "not a .npy file"},
      {"text_file", "hello, this is not an array\n", "bad magic"},
      {"version_4", NpyBytes(4, Dict("<f4", "(2, 3)"), six), "version 4.0"},
      {"header_past_eof", huge_len, "truncated .npy header"},
      {"truncated_data", NpyBytes(1, Dict("<f4", "(2, 3)"), six.substr(0, 20)), "(truncated)"},
      {"trailing_bytes", NpyBytes(1, Dict("<f4", "(2, 3)"), six + "xxxx"), "trailing bytes"},
      {"shape_vs_bytes", NpyBytes(1, Dict("<f4", "(3, 3)"), six), "needs 36 data bytes"},
      {"fortran", NpyBytes(1, "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", six),
       "Fortran-order"},
      {"float64", NpyBytes(1, Dict("<f8", "(3,)"), six), "unsupported dtype '<f8'"},
      {"big_endian", NpyBytes(1, Dict(">f4", "(2, 3)"), six), "big-endian"},
      {"object", NpyBytes(1, Dict("|O", "(2, 3)"), six), "unsupported dtype '|O'"},
      {"garbage_header", NpyBytes(1, "this is not a dict", six), "malformed .npy header"},
      {"missing_shape", NpyBytes(1, "{'descr': '<f4', 'fortran_order': False}", six),
       "lacks one of"},
      {"extra_key",
       NpyBytes(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), 'x': 1}", six),
       "unexpected key"},
      {"negative_dim", NpyBytes(1, Dict("<f4", "(2, -3)"), six), "non-negative integer"},
      {"huge_shape", NpyBytes(1, Dict("<f4", "(4294967296, 4294967296)"), ""), "is too large"},
      // No elements, but the other dims' product (a row's size) overflows.
      {"empty_huge_rows", NpyBytes(1, Dict("<f4", "(0, 4294967296, 4294967296)"), ""),
       "is too large"},
      {"shape_not_tuple", NpyBytes(1, Dict("<f4", "(6)"), six), "must be a tuple"},
      {"bad_bool", NpyBytes(1, "{'descr': '<f4', 'fortran_order': maybe, 'shape': (6,)}", six),
       "True or False"},
      {"unterminated", NpyBytes(1, "{'descr': '<f4", six), "unterminated string"},
      {"trailing_text", NpyBytes(1, Dict("<f4", "(2, 3)") + " junk", six), "trailing text"},
      {"duplicate_key",
       NpyBytes(1,
                "{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, "
                "'shape': (6,)}",
                six),
       "'descr' twice"},
  };
}

TEST(Npy, RefusesMalformedFilesNamingThem) {
  ScratchDir dir;
  for (const BadFile& bad : BadFiles()) {
    SCOPED_TRACE(bad.name);
    const std::string path = WriteFile(dir, std::string(bad.name) + ".npy", bad.bytes);
    try {
      NpyArray::Open(path);
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_EQ(msg.rfind(path + ": ", 0), 0u) << msg;
      EXPECT_NE(msg.find(bad.message), std::string::npos) << msg;
    }
  }
}

TEST(Npy, RefusesMissingFilesAndDirectories) {
  ScratchDir dir;
  for (const std::string& path : {dir / "nope.npy", dir.path()}) {
    try {
      NpyArray::Open(path);
      ADD_FAILURE() << "accepted " << path;
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).rfind(path + ": ", 0), 0u) << e.what();
    }
  }
}

TEST(Npy, RefusesConversionsThatLoseMeaning) {
  ScratchDir dir;
  const NpyArray f = NpyArray::Open(
      WriteFile(dir, "f.npy", NpyBytes(1, Dict("<f4", "(2,)"), Raw(std::vector<float>{1, 2}))));
  EXPECT_THROW(f.Load(DType::kI32, "segment ids"), Error);
  EXPECT_THROW(f.Load(DType::kBool, "mask"), Error);
  const NpyArray i = NpyArray::Open(
      WriteFile(dir, "i.npy", NpyBytes(1, Dict("<i4", "(2,)"), Raw(std::vector<int32_t>{1, 2}))));
  EXPECT_THROW(i.Load(DType::kF32, "q"), Error);
  const NpyArray big = NpyArray::Open(WriteFile(
      dir, "big.npy", NpyBytes(1, Dict("<i8", "(2,)"), Raw(std::vector<int64_t>{1, 1LL << 40}))));
  try {
    big.Load(DType::kI32, "segment ids");
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not fit in int32"), std::string::npos);
  }
}

}  // namespace
}  // namespace ringsplash::npy
