// Boolean switches from the environment (FSDP_BENCH_LOCAL_COLLECTIVES, FSDP_COMM_STATS, ...),
// parsed one way everywhere in src/distributed: "1" is on, "0" is off, unset or empty is the
// default, anything else is refused naming the variable (a typo must not silently run the other
// mode). Private to src/distributed.
#pragma once

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace fsdp::detail {

inline bool env_switch(const char* name, bool unset = false) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0')
    return unset;
  if (std::strcmp(v, "0") == 0 || std::strcmp(v, "1") == 0)
    return *v == '1';
  throw std::invalid_argument(std::string(name) + "=\"" + v + "\" must be 0 or 1");
}

}  // namespace fsdp::detail
