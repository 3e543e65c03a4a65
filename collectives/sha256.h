#pragma once

// SHA-256 (FIPS 180-4), for checkpoint checksums and result digests.

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace ctorchrun::dist {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t size);
  void update(std::string_view data) { update(data.data(), data.size()); }
  std::array<uint8_t, 32> finish();

 private:
  void block(const uint8_t* p);

  uint32_t state_[8];
  uint8_t buffer_[64];
  size_t buffered_ = 0;
  uint64_t total_ = 0;
};

std::array<uint8_t, 32> sha256(const void* data, size_t size);
// Lower-case hex of the digest.
std::string sha256_hex(const void* data, size_t size);
std::string to_hex(const uint8_t* data, size_t size);

}  // namespace ctorchrun::dist
