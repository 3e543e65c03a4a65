#pragma once

// Base64 (RFC 4648, standard alphabet, with padding), as etcd's JSON gateway
// encodes every key and value.
//
// decode() is total: it accepts exactly the canonical encodings (length a
// multiple of 4, only alphabet characters, '=' only as the last one or two,
// unused trailing bits zero) and returns nullopt for anything else.

#include <optional>
#include <string>
#include <string_view>

namespace ctorchrun::etcd {

std::string base64_encode(std::string_view bytes);
std::optional<std::string> base64_decode(std::string_view text);

}  // namespace ctorchrun::etcd
