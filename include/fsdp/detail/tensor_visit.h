// Which tensors an argument or a result of a unit's forward holds: fsdp::forward must see every
// tensor that enters a unit (to learn when the unit's backward is done) and every tensor that
// leaves it (to gather the unit again when backward reaches it).
//
// Understood without help: torch::Tensor; std::vector, std::array, std::deque, std::optional,
// std::pair, std::tuple, std::map and std::unordered_map (values), torch::OrderedDict (values)
// of those, nested to any depth; and types that hold no tensor (arithmetic types, enums,
// strings, torch::Device, torch::ScalarType, torch::TensorOptions, c10::Scalar, int64_t arrays,
// std::nullopt). A type of yours declares its tensors with one member template, the
// customisation point:
//
//   struct Output {
//     torch::Tensor logits;
//     std::optional<torch::Tensor> aux_loss;
//     int64_t n_tokens;
//     template <typename F>
//     void visit_tensors(F&& f) { f(logits); f(aux_loss); }  // each field that may hold one
//   };
//
// `f` accepts anything this header understands (a tensor, an optional, a nested struct with its
// own visit_tensors...). A type without tensors declares an empty visit_tensors. Any other type
// passed to or returned from fsdp::forward is a compile-time error, never a silently unhooked
// tensor. To pass an object by non-const reference (a KV cache updated in place), wrap it in
// std::ref: it is passed through as it is, and fsdp::forward throws if one of its tensors
// requires grad, since that tensor's gradient would escape the unit's hooks.
#pragma once

#include <torch/ordered_dict.h>
#include <torch/types.h>

#include <array>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

namespace fsdp::detail {

template <typename T>
inline constexpr bool kAlwaysFalse = false;

template <typename T>
struct IsSpecOf : std::false_type {};
template <typename T, typename A>
struct IsSpecOf<std::vector<T, A>> : std::true_type {};
template <typename T, typename A>
struct IsSpecOf<std::deque<T, A>> : std::true_type {};
template <typename T, size_t N>
struct IsSpecOf<std::array<T, N>> : std::true_type {};

template <typename T>
struct IsOptional : std::false_type {};
template <typename T>
struct IsOptional<std::optional<T>> : std::true_type {};

template <typename T>
struct IsPair : std::false_type {};
template <typename A, typename B>
struct IsPair<std::pair<A, B>> : std::true_type {};

template <typename T>
struct IsTuple : std::false_type {};
template <typename... Ts>
struct IsTuple<std::tuple<Ts...>> : std::true_type {};

template <typename T>
struct IsMap : std::false_type {};
template <typename K, typename V, typename C, typename A>
struct IsMap<std::map<K, V, C, A>> : std::true_type {};
template <typename K, typename V, typename H, typename E, typename A>
struct IsMap<std::unordered_map<K, V, H, E, A>> : std::true_type {};

template <typename T>
struct IsOrderedDict : std::false_type {};
template <typename K, typename V>
struct IsOrderedDict<torch::OrderedDict<K, V>> : std::true_type {};

template <typename T>
struct IsRefWrapper : std::false_type {};
template <typename T>
struct IsRefWrapper<std::reference_wrapper<T>> : std::true_type {};

// Types that cannot hold a tensor.
template <typename T>
inline constexpr bool kTensorFreeLeaf =
    std::is_arithmetic_v<T> || std::is_enum_v<T> || std::is_same_v<T, std::string> ||
    std::is_same_v<T, std::string_view> || std::is_same_v<T, const char*> ||
    std::is_same_v<T, char*> || std::is_same_v<T, std::nullopt_t> ||
    std::is_same_v<T, std::nullptr_t> || std::is_same_v<T, std::monostate> ||
    std::is_same_v<T, c10::Device> || std::is_same_v<T, c10::ScalarType> ||
    std::is_same_v<T, c10::Layout> || std::is_same_v<T, c10::MemoryFormat> ||
    std::is_same_v<T, c10::Scalar> || std::is_same_v<T, c10::TensorOptions> ||
    std::is_same_v<T, c10::IntArrayRef> || std::is_same_v<T, c10::SymIntArrayRef>;

// A no-op visitor, to detect the customisation point.
struct AnyTensorSink {
  template <typename U>
  void operator()(U&&) const {}
};

template <typename T>
concept HasVisitTensors = requires(T& t) {
  t.visit_tensors(AnyTensorSink{});
};

enum class Walk { kNoTensors, kTensors, kUnsupported };

// What fsdp::forward can do with a T: nothing to do (no tensor can be inside), walk it, or
// refuse it at compile time.
template <typename T>
constexpr Walk walk_kind() {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, torch::Tensor>) {
    return Walk::kTensors;
  } else if constexpr (kTensorFreeLeaf<U>) {
    return Walk::kNoTensors;
  } else if constexpr (IsSpecOf<U>::value || IsOptional<U>::value) {
    return walk_kind<typename U::value_type>();
  } else if constexpr (IsMap<U>::value) {
    if constexpr (walk_kind<typename U::key_type>() != Walk::kNoTensors)
      return Walk::kUnsupported;  // tensors as map keys: no
    else
      return walk_kind<typename U::mapped_type>();
  } else if constexpr (IsOrderedDict<U>::value) {
    return walk_kind<typename U::Item::value_type>() == Walk::kUnsupported ? Walk::kUnsupported
                                                                           : Walk::kTensors;
  } else if constexpr (IsPair<U>::value) {
    constexpr Walk a = walk_kind<typename U::first_type>();
    constexpr Walk b = walk_kind<typename U::second_type>();
    if constexpr (a == Walk::kUnsupported || b == Walk::kUnsupported)
      return Walk::kUnsupported;
    else
      return a == Walk::kTensors || b == Walk::kTensors ? Walk::kTensors : Walk::kNoTensors;
  } else if constexpr (IsTuple<U>::value) {
    return []<typename... Ts>(std::type_identity<std::tuple<Ts...>>) {
      constexpr Walk kinds[] = {Walk::kNoTensors, walk_kind<Ts>()...};
      Walk out = Walk::kNoTensors;
      for (Walk k : kinds) {
        if (k == Walk::kUnsupported)
          return Walk::kUnsupported;
        if (k == Walk::kTensors)
          out = Walk::kTensors;
      }
      return out;
    }(std::type_identity<U>{});
  } else if constexpr (HasVisitTensors<U>) {
    return Walk::kTensors;
  } else {
    return Walk::kUnsupported;
  }
}

template <typename T>
inline constexpr bool kWalkable = walk_kind<T>() != Walk::kUnsupported;
template <typename T>
inline constexpr bool kMayHoldTensors = walk_kind<T>() == Walk::kTensors;

/// Calls f(torch::Tensor&) on every tensor inside `value`, in a fixed order (the order of
/// members, elements, and for maps, keys). Undefined tensors are visited too.
template <typename T, typename F>
void walk_tensors(T& value, F& f) {
  using U = std::remove_cv_t<T>;
  static_assert(kWalkable<U>,
                "fsdp::forward: this type may hold tensors fsdp cannot see. Give it a member "
                "`template <typename F> void visit_tensors(F&& f)` that calls f on each tensor "
                "field (see fsdp/detail/tensor_visit.h), or pass it with std::ref");
  if constexpr (std::is_same_v<U, torch::Tensor>) {
    f(value);
  } else if constexpr (walk_kind<U>() == Walk::kNoTensors) {
    // nothing inside
  } else if constexpr (IsSpecOf<U>::value) {
    for (auto& e : value)
      walk_tensors(e, f);
  } else if constexpr (IsOptional<U>::value) {
    if (value)
      walk_tensors(*value, f);
  } else if constexpr (IsMap<U>::value) {
    for (auto& kv : value)
      walk_tensors(kv.second, f);
  } else if constexpr (IsOrderedDict<U>::value) {
    for (auto& item : value)
      walk_tensors(item.value(), f);
  } else if constexpr (IsPair<U>::value) {
    walk_tensors(value.first, f);
    walk_tensors(value.second, f);
  } else if constexpr (IsTuple<U>::value) {
    std::apply([&](auto&... e) { (walk_tensors(e, f), ...); }, value);
  } else {
    value.visit_tensors([&](auto& field) { walk_tensors(field, f); });
  }
}

}  // namespace fsdp::detail
