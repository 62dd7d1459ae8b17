// How deeply a JSON text nests, checked before a parser builds it.
//
// nlohmann::json parses any depth without recursion, but dumping, copying or comparing what it
// built recurses once per level: a checkpoint index of 100,000 nested arrays (200 KB, within
// every size bound) overflowed the stack of the rank that read it (SIGSEGV) instead of failing
// with a message. Every reader of a JSON file from outside checks the text first.
#pragma once

#include <string>
#include <string_view>

namespace fsdp {

/// The deepest nesting any JSON we read may have. The files have at most 6 levels (a
/// tokenizer.json's pre-tokenizer sequence); 64 leaves room for what we do not know of.
inline constexpr int kMaxJsonDepth = 64;

/// "" if `text` nests at most `max_depth` arrays and objects deep; otherwise what to say after
/// the file's name: "JSON nested deeper than 64 levels (byte 64)". Brackets inside strings do
/// not count. Not a validator: the parser still checks the rest.
std::string json_too_deep(std::string_view text, int max_depth = kMaxJsonDepth);

}  // namespace fsdp
