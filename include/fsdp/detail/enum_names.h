// The names of the enums a configuration spells as strings (ShardingStrategy, BackwardPrefetch,
// CheckpointMode, GatherFormat), written once: each enum's header specialises EnumNames next
// to the enum, and to_string, from_string and enum_names (the allowed values a config lists)
// all read that one table.
#pragma once

#include <c10/util/Exception.h>

#include <string>
#include <string_view>
#include <vector>

namespace fsdp {

/// Specialised for each named enum: `what` (for messages) and `names`, an array of
/// {value, name} pairs covering every value.
template <class E>
struct EnumNames;

template <class E>
concept NamedEnum = requires {
  EnumNames<E>::names;
};

/// The name of `e` ("full_shard").
template <NamedEnum E>
const char* to_string(E e) {
  for (const auto& [value, name] : EnumNames<E>::names) {
    if (value == e)
      return name;
  }
  return "?";
}

/// Every name of E, in declaration order.
template <NamedEnum E>
std::vector<std::string> enum_names() {
  std::vector<std::string> out;
  for (const auto& entry : EnumNames<E>::names)
    out.emplace_back(entry.second);
  return out;
}

/// The value named `name`; an unknown name throws one line naming the allowed ones.
template <NamedEnum E>
E from_string(std::string_view name) {
  std::string allowed;
  for (const auto& [value, n] : EnumNames<E>::names) {
    if (name == n)
      return value;
    allowed += (allowed.empty() ? "" : ", ") + std::string(n);
  }
  TORCH_CHECK(false, "unknown ", EnumNames<E>::what, " '", name, "' (allowed: ", allowed, ")");
}

}  // namespace fsdp
