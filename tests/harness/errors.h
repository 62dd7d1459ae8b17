// What a call throws, for tests of error messages.
#pragma once

#include <exception>
#include <string>

namespace fsdp::test {

/// The message of the exception `fn` throws ("" if none).
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace fsdp::test
