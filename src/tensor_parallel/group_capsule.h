// A process group carried in an autograd context (saved_data holds IValues only).
#pragma once

#include <ATen/core/ivalue.h>

#include <memory>

#include <fsdp/distributed/process_group.h>

namespace fsdp::tp::detail {

struct GroupHolder : torch::CustomClassHolder {
  explicit GroupHolder(std::shared_ptr<ProcessGroup> g) : group(std::move(g)) {}
  std::shared_ptr<ProcessGroup> group;
};

inline c10::IValue capsule(std::shared_ptr<ProcessGroup> group) {
  return c10::IValue::make_capsule(c10::make_intrusive<GroupHolder>(std::move(group)));
}

inline ProcessGroup& group_of(const c10::IValue& v) {
  return *c10::static_intrusive_pointer_cast<GroupHolder>(v.toCapsule())->group;
}

}  // namespace fsdp::tp::detail
