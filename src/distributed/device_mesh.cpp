// See fsdp/distributed/device_mesh.h.
#include <fsdp/distributed/device_mesh.h>

#include <stdexcept>
#include <string>

namespace fsdp {

DeviceMesh2D make_device_mesh(ProcessGroup& world, int tp) {
  if (tp < 1 || world.size() % tp != 0)
    throw std::invalid_argument("make_device_mesh: tp = " + std::to_string(tp) +
                                " must divide the world's " + std::to_string(world.size()) +
                                " ranks");
  DeviceMesh2D mesh;
  mesh.tp = world.block_group(tp);
  mesh.dp = world.strided_group(tp);
  return mesh;
}

}  // namespace fsdp
