// A weak reference to an autograd node, under the pointer type this torch holds nodes by.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <memory>
#include <type_traits>
#include <utility>

namespace fsdp::detail {

// Whichever pointer this torch holds autograd nodes by: a std::shared_ptr in torch 2.11 (what
// GPU images carry), a c10::intrusive_ptr in 2.15. Tensor::grad_fn() says which.
template <typename P>
struct WeakPointerOf;
template <typename T>
struct WeakPointerOf<std::shared_ptr<T>> {
  using type = std::weak_ptr<T>;
};
template <typename T>
struct WeakPointerOf<c10::intrusive_ptr<T>> {
  using type = c10::weak_intrusive_ptr<T>;
};
using WeakNode =
    typename WeakPointerOf<std::decay_t<decltype(std::declval<at::Tensor>().grad_fn())>>::type;

}  // namespace fsdp::detail
