// Bounds-checked little-endian readers and growing writers for codec payloads (decoders never trust input).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

namespace kdn {

// Reads from [data, data+size); every read checks the bounds and turns `ok` false instead of
// reading past the end (later reads then return zeros). Callers check ok() once per section.
class ByteReader {
 public:
  ByteReader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  template <typename T>
  T get() {
    T value{};
    if (!need(sizeof(T))) return value;
    std::memcpy(&value, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return value;
  }
  // A pointer to the next n bytes (advancing past them), or nullptr when fewer remain.
  const uint8_t* take(size_t n) {
    if (!need(n)) return nullptr;
    const uint8_t* p = data_ + pos_;
    pos_ += n;
    return p;
  }
  bool ok() const { return ok_; }
  size_t remaining() const { return ok_ ? size_ - pos_ : 0; }

 private:
  bool need(size_t n) {
    if (!ok_ || n > size_ - pos_) ok_ = false;
    return ok_;
  }
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
  bool ok_ = true;
};

class ByteWriter {
 public:
  template <typename T>
  void put(T value) {
    const size_t at = out.size();
    out.resize(at + sizeof(T));
    std::memcpy(out.data() + at, &value, sizeof(T));
  }
  void append(const uint8_t* p, size_t n) { out.insert(out.end(), p, p + n); }
  std::vector<uint8_t> out;
};

}  // namespace kdn
