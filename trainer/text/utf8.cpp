#include "utf8.h"

namespace fsdp_trainer {

size_t utf8_length(std::string_view s) {
  if (s.empty())
    return 0;
  const auto b = static_cast<unsigned char>(s[0]);
  if (b < 0x80)
    return 1;
  size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // the range of the second byte
  if (b >= 0xC2 && b < 0xE0) {
    n = 2;
  } else if (b >= 0xE0 && b < 0xF0) {
    n = 3;
    lo = b == 0xE0 ? 0xA0 : 0x80;
    hi = b == 0xED ? 0x9F : 0xBF;
  } else if (b >= 0xF0 && b < 0xF5) {
    n = 4;
    lo = b == 0xF0 ? 0x90 : 0x80;
    hi = b == 0xF4 ? 0x8F : 0xBF;
  } else {
    return 0;
  }
  if (s.size() < n)
    return 0;
  for (size_t k = 1; k < n; ++k) {
    const auto c = static_cast<unsigned char>(s[k]);
    if (c < (k == 1 ? lo : 0x80) || c > (k == 1 ? hi : 0xBF))
      return 0;
  }
  return n;
}

size_t utf8_lead_length(unsigned char lead) {
  return lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 1;
}

std::string printable_utf8(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t i = 0; i < bytes.size();) {
    const size_t n = utf8_length(bytes.substr(i));
    if (n == 0) {
      out += "\xEF\xBF\xBD";  // U+FFFD
      ++i;
    } else {
      out.append(bytes.substr(i, n));
      i += n;
    }
  }
  return out;
}

void append_byte_run(std::string& out, std::string_view run) {
  for (size_t i = 0; i < run.size();) {
    const size_t n = utf8_length(run.substr(i));
    if (n == 0) {
      for (size_t k = 0; k < run.size(); ++k)
        out += "\xEF\xBF\xBD";  // U+FFFD
      return;
    }
    i += n;
  }
  out.append(run);
}

}  // namespace fsdp_trainer
