// The all-gather's wire formats (GatherCodec, MixedPrecisionPolicy::gather_format), in one
// process: the int8 format decodes to exactly what an independent formulation in ATen ops
// gives (scale = block absmax / 127, values rounded to nearest even), within half a step of
// the input, the same however the rows are split into pieces (ranks), with the byte count the
// layout says; narrow rows and cast formats fall back as documented.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "engine/gather_codec.h"
#include "harness/wire_format.h"

namespace {

using fsdp::GatherFormat;
using fsdp::MixedPrecisionPolicy;
using fsdp::detail::GatherCodec;
using fsdp::test::int8_reference;

torch::Tensor round_trip(const GatherCodec& codec, const torch::Tensor& rows,
                         torch::ScalarType compute, int64_t pieces) {
  const int64_t per = rows.size(0) / pieces;
  std::vector<torch::Tensor> wires;
  for (int64_t p = 0; p < pieces; ++p)
    wires.push_back(codec.encode(rows.narrow(0, p * per, per).contiguous()));
  auto wire = torch::cat(wires);
  auto out = torch::empty(rows.sizes(), rows.options().dtype(compute));
  codec.decode(wire, out, pieces);
  return out;
}

torch::Tensor sample(int64_t rows, int64_t width) {
  torch::manual_seed(3);
  auto x = torch::randn({rows, width});
  x.index_put_({1, 5}, 40.0);   // an outlier: its block gets a coarse scale
  x.narrow(0, 2, 1).zero_();    // an all-zero row: scale 0, decodes to 0
  x.index_put_({3, 0}, 1e-30);  // a tiny value next to large ones
  return x;
}

TEST(GatherCodec, Int8EqualsTheReferenceAndIsWithinHalfAStep) {
  const int64_t block = 16, width = 37;  // blocks of 16, 16 and 5
  auto codec = GatherCodec::make(
      MixedPrecisionPolicy().gather_format(GatherFormat::kInt8).int8_block_size(block),
      torch::kFloat, torch::kFloat, width);
  ASSERT_TRUE(codec && codec->is_int8());
  auto x = sample(12, width);
  auto got = round_trip(*codec, x, torch::kFloat, 1);
  auto want = int8_reference(x, block);
  EXPECT_TRUE(torch::equal(got, want)) << (got - want).abs().max();
  EXPECT_TRUE(torch::equal(got[2], torch::zeros({width})));
  // Every value within half a quantisation step of its block.
  for (int64_t s = 0; s < width; s += block) {
    const int64_t len = std::min(block, width - s);
    auto step = x.narrow(1, s, len).abs().amax(1, true) / 127;
    auto err = (got.narrow(1, s, len) - x.narrow(1, s, len)).abs();
    EXPECT_TRUE((err <= step * 0.5 + 1e-7).all().item<bool>()) << (err - step * 0.5).max();
  }
  // The outlier's block is coarse, the others are not dragged along.
  EXPECT_LT((got[1].narrow(0, 16, 21) - x[1].narrow(0, 16, 21)).abs().max().item<float>(), 0.02);
}

TEST(GatherCodec, Int8DoesNotDependOnHowRowsAreSplit) {
  auto codec = GatherCodec::make(
      MixedPrecisionPolicy().gather_format(GatherFormat::kInt8).int8_block_size(16), torch::kFloat,
      torch::kFloat, 37);
  auto x = sample(12, 37);
  auto one = round_trip(*codec, x, torch::kFloat, 1);
  for (int64_t pieces : {2, 3, 4, 6}) {
    EXPECT_TRUE(torch::equal(round_trip(*codec, x, torch::kFloat, pieces), one)) << pieces;
  }
  // Wire size: per piece, 4 bytes per (row, block) + 1 per value, padded to 4 bytes.
  EXPECT_EQ(codec->wire_numel(4), (4 * 3 * 4 + 4 * 37 + 3) / 4 * 4);
  EXPECT_EQ(codec->wire_numel(3), 148);  // 36 + 111 = 147, padded to 148
}

TEST(GatherCodec, Int8DecodesIntoLowPrecisionComputeAndPropagatesNaN) {
  auto codec = GatherCodec::make(MixedPrecisionPolicy()
                                     .param_dtype(torch::kBFloat16)
                                     .gather_format(GatherFormat::kInt8)
                                     .int8_block_size(16),
                                 torch::kFloat, torch::kBFloat16, 37);
  auto x = sample(6, 37);
  auto got = round_trip(*codec, x, torch::kBFloat16, 2);
  EXPECT_TRUE(torch::equal(got, int8_reference(x, 16).to(torch::kBFloat16)));
  x.index_put_({0, 20}, std::nan(""));
  auto bad = round_trip(*codec, x, torch::kFloat, 1);
  EXPECT_TRUE(bad[0].narrow(0, 16, 16).isnan().all().item<bool>());  // the NaN's block
  EXPECT_FALSE(bad[0].narrow(0, 0, 16).isnan().any().item<bool>());  // not its neighbours
}

// Tensors off the CPU take the ATen-only path: the same bytes and the same decoded values.
TEST(GatherCodec, PortablePathGivesTheSameBytes) {
  for (auto compute : {torch::kFloat, torch::kBFloat16}) {
    auto codec = GatherCodec::make(MixedPrecisionPolicy()
                                       .param_dtype(compute)
                                       .gather_format(GatherFormat::kInt8)
                                       .int8_block_size(16),
                                   torch::kFloat, compute, 37);
    auto x = sample(6, 37);
    x.index_put_({4, 30}, std::nan(""));
    auto fast = codec->encode(x), portable = codec->encode(x, /*portable=*/true);
    EXPECT_TRUE(torch::equal(fast, portable));
    auto wire = torch::cat({fast, fast});
    auto a = torch::empty({12, 37}, torch::TensorOptions().dtype(compute));
    auto b = torch::empty({12, 37}, torch::TensorOptions().dtype(compute));
    codec->decode(wire, a, 2);
    codec->decode(wire, b, 2, /*portable=*/true);
    EXPECT_TRUE(torch::equal(a.nan_to_num(7), b.nan_to_num(7)));
    EXPECT_EQ(a.isnan().sum().item<int64_t>(), 2 * 16);  // the NaN's block (16 values) per piece
  }
}

TEST(GatherCodec, CastFormatsAndFallbacks) {
  const auto mp = [](GatherFormat f) { return MixedPrecisionPolicy().gather_format(f); };
  // Nothing to encode: the compute dtype, integer parameters, a format equal to compute.
  EXPECT_FALSE(
      GatherCodec::make(mp(GatherFormat::kComputeDtype), torch::kFloat, torch::kFloat, 64));
  EXPECT_FALSE(GatherCodec::make(mp(GatherFormat::kInt8), torch::kInt, torch::kInt, 64));
  EXPECT_FALSE(GatherCodec::make(mp(GatherFormat::kBFloat16).param_dtype(torch::kBFloat16),
                                 torch::kFloat, torch::kBFloat16, 64));
  // Rows narrower than 16 values travel as bf16 under int8.
  auto narrow = GatherCodec::make(mp(GatherFormat::kInt8), torch::kFloat, torch::kFloat, 15);
  ASSERT_TRUE(narrow);
  EXPECT_FALSE(narrow->is_int8());
  EXPECT_EQ(narrow->wire_dtype(), torch::kBFloat16);
  auto x = sample(6, 15);
  EXPECT_TRUE(torch::equal(round_trip(*narrow, x, torch::kFloat, 3),
                           x.to(torch::kBFloat16).to(torch::kFloat)));
  auto fp16 = GatherCodec::make(mp(GatherFormat::kFloat16), torch::kFloat, torch::kFloat, 40);
  ASSERT_TRUE(fp16);
  EXPECT_EQ(fp16->wire_numel(3), 120);
  auto y = sample(6, 40);
  EXPECT_TRUE(
      torch::equal(round_trip(*fp16, y, torch::kFloat, 2), y.to(torch::kHalf).to(torch::kFloat)));
}

}  // namespace
