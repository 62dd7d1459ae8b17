// See include/fsdp/plan/tp_traffic.h.
#include <fsdp/plan/tp_traffic.h>

#include <cmath>

namespace fsdp::plan {

int64_t buffer_bytes(const CommStats& s) {
  return s.all_reduce.bytes + s.all_gather.bytes + s.reduce_scatter.bytes;
}

int64_t TrafficScaling::Line::at(int64_t b, int64_t t) const {
  const double bd = static_cast<double>(b), td = static_cast<double>(t);
  return std::llround(c + p * td + a * bd * td);
}

std::array<int64_t, 6> TrafficScaling::values(const CommStats& s) {
  return {s.all_reduce.calls, s.all_reduce.bytes,     s.all_gather.calls,
          s.all_gather.bytes, s.reduce_scatter.calls, s.reduce_scatter.bytes};
}

CommStats TrafficScaling::at(int64_t b, int64_t t) const {
  CommStats s;
  s.all_reduce.calls = counts[0].at(b, t);
  s.all_reduce.bytes = counts[1].at(b, t);
  s.all_gather.calls = counts[2].at(b, t);
  s.all_gather.bytes = counts[3].at(b, t);
  s.reduce_scatter.calls = counts[4].at(b, t);
  s.reduce_scatter.bytes = counts[5].at(b, t);
  return s;
}

TrafficScaling TrafficScaling::fit(int64_t b, int64_t t, const CommStats& at_bt,
                                   const CommStats& at_2b, const CommStats& at_2t) {
  // m(B,T) = c + p·T + a·B·T:  m(2b,t) - m(b,t) = a·b·t,  m(b,2t) - m(b,t) = p·t + a·b·t.
  const auto m = values(at_bt), m2b = values(at_2b), m2t = values(at_2t);
  const double bt = static_cast<double>(b) * static_cast<double>(t), td = static_cast<double>(t);
  TrafficScaling out;
  for (size_t i = 0; i < m.size(); ++i) {
    auto& line = out.counts[i];
    line.a = static_cast<double>(m2b[i] - m[i]) / bt;
    line.p = (static_cast<double>(m2t[i] - m[i]) - line.a * bt) / td;
    line.c = static_cast<double>(m[i]) - line.p * td - line.a * bt;
  }
  return out;
}

}  // namespace fsdp::plan
