// Shared basics of the kdn C++ core: KDN_HD, dtypes, status codes and the boundary exception.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#if defined(__CUDACC__)
#define KDN_HD __host__ __device__ __forceinline__
#else
#define KDN_HD inline
#endif

namespace kdn {

static_assert(sizeof(void*) == 8, "kdn needs a 64-bit platform");
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "kdn blobs and keys assume a little-endian host");

// Element types the core understands. Values are stable: they are written into blob headers.
enum class DType : uint8_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

inline bool dtype_is_valid(uint8_t code) { return code <= 2; }

KDN_HD int64_t dtype_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

inline const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
  }
  return "unknown";
}

// Status returned inside the library; converted to kdn::Error at the boundary.
struct Status {
  bool ok = true;
  std::string message;
  static Status Ok() { return {}; }
  static Status Fail(std::string msg) { return {false, std::move(msg)}; }
};

// The one exception type thrown out of the core. It keeps the file and line of the check for a
// debugger (file(), line()); its message is the check's alone, so no build path reaches a user.
class Error : public std::runtime_error {
 public:
  Error(const std::string& what, const char* file, int line)
      : std::runtime_error(what), file_(file), line_(line) {}
  const char* file() const noexcept { return file_; }
  int line() const noexcept { return line_; }

 private:
  const char* file_;
  int line_;
};

// Raised for input data (blobs) that fails validation; mapped to kdn.BlobError in Python.
class BlobError : public Error {
 public:
  using Error::Error;
};

}  // namespace kdn

#define KDN_CHECK(cond, msg)                                                  \
  do {                                                                        \
    if (!(cond)) throw ::kdn::Error(std::string(msg), __FILE__, __LINE__);    \
  } while (0)

#define KDN_THROW_IF_FAILED(status)                                           \
  do {                                                                        \
    const ::kdn::Status& kdn_st_ = (status);                                  \
    if (!kdn_st_.ok) throw ::kdn::Error(kdn_st_.message, __FILE__, __LINE__); \
  } while (0)

namespace kdn {
// Raised for bad arguments from the caller (wrong dtype, shape, device); kdn.InvalidInputError.
class InputError : public Error {
 public:
  using Error::Error;
};
}  // namespace kdn

#define KDN_CHECK_INPUT(cond, msg)                                                \
  do {                                                                            \
    if (!(cond)) throw ::kdn::InputError(std::string(msg), __FILE__, __LINE__);   \
  } while (0)
