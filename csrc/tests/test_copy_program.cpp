// C++ tests of the copy-program index math, validation and the CPU executor (run by ctest).
// The oracle is an element-by-element loop over the segment definition.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "reshard/reshard.h"
#include "tests/expect.h"

using verl::reshard::Segment;


static bool valid(const std::vector<Segment>& p, int64_t sn, int64_t dn, int64_t es, int64_t align) {
  char msg[verl::reshard::kMessageBytes];
  return verl::reshard::validate_program(p.data(), static_cast<int64_t>(p.size()), sn, dn, es, align, msg,
                                         sizeof(msg));
}

static void reference(const std::vector<uint8_t>& src, std::vector<uint8_t>& dst, const std::vector<Segment>& prog,
                      int64_t es) {
  for (const Segment& s : prog) {
    for (int64_t r = 0; r < s.rows; ++r) {
      for (int64_t e = 0; e < s.row_elems * es; ++e) {
        dst[(s.dst_offset + r * s.dst_stride) * es + e] = src[(s.src_offset + r * s.src_stride) * es + e];
      }
    }
  }
}

// A random valid program: destination rows are carved from disjoint slots so writes never overlap.
static std::vector<Segment> random_program(std::mt19937_64& rng, int64_t src_numel, int64_t dst_numel,
                                           int64_t max_row) {
  std::vector<Segment> prog;
  int64_t cursor = 0;
  std::uniform_int_distribution<int64_t> small(0, 4);
  while (true) {
    Segment s{};
    s.rows = 1 + small(rng);
    s.row_elems = 1 + static_cast<int64_t>(rng() % max_row);
    s.dst_stride = s.row_elems + small(rng);
    s.src_stride = static_cast<int64_t>(rng() % (2 * s.row_elems + 1));
    s.dst_offset = cursor + small(rng);
    const int64_t dst_end = s.dst_offset + (s.rows - 1) * s.dst_stride + s.row_elems;
    const int64_t src_span = (s.rows - 1) * s.src_stride + s.row_elems;
    if (dst_end > dst_numel || src_span > src_numel) break;
    s.src_offset = static_cast<int64_t>(rng() % (src_numel - src_span + 1));
    cursor = dst_end;
    prog.push_back(s);
  }
  std::shuffle(prog.begin(), prog.end(), rng);
  return prog;
}

static void test_unit_math() {
  Segment s{10, 20, 3, 100, 200, 150};
  // 400-byte rows (fp32) in 128-byte chunks: 4 chunks per row, the last one 16 bytes.
  EXPECT(verl::reshard::chunks_per_row(400, 128) == 4);
  EXPECT(verl::reshard::segment_units(s, 4, 128) == 12);
  auto u = verl::reshard::unit_copy(s, 7, 4, 128);  // row 1, chunk 3
  EXPECT(u.src_byte == (10 + 200) * 4 + 384);
  EXPECT(u.dst_byte == (20 + 150) * 4 + 384);
  EXPECT(u.nbytes == 16);
  Segment contiguous{0, 0, 8, 16, 16, 16};
  Segment strided{0, 0, 8, 16, 16, 20};
  EXPECT(verl::reshard::coalesce_rows(contiguous).rows == 1 && verl::reshard::coalesce_rows(contiguous).row_elems == 128);
  EXPECT(verl::reshard::coalesce_rows(strided).rows == 8);
  std::vector<int64_t> begin = {0, 3, 3, 10};  // segment 1 is empty
  EXPECT(verl::reshard::find_segment(begin.data(), 3, 0) == 0);
  EXPECT(verl::reshard::find_segment(begin.data(), 3, 2) == 0);
  EXPECT(verl::reshard::find_segment(begin.data(), 3, 3) == 2);
  EXPECT(verl::reshard::find_segment(begin.data(), 3, 9) == 2);
}

static void test_random_programs_match_reference() {
  std::mt19937_64 rng(1234);
  for (int64_t es : {1, 2, 4}) {
    for (int trial = 0; trial < 200; ++trial) {
      const int64_t src_numel = 1 + rng() % 5000, dst_numel = 1 + rng() % 5000;
      // Every few trials use rows larger than a CPU chunk so multi-chunk rows are exercised.
      const int64_t max_row = (trial % 7 == 0) ? 200000 : 64;
      const int64_t sn = trial % 7 == 0 ? 600000 : src_numel, dn = trial % 7 == 0 ? 600000 : dst_numel;
      auto prog = random_program(rng, sn, dn, max_row);
      EXPECT(valid(prog, sn, dn, es, 0));
      std::vector<uint8_t> src(sn * es), dst(dn * es, 0xAB), want(dn * es, 0xAB);
      for (auto& b : src) b = static_cast<uint8_t>(rng());
      reference(src, want, prog, es);
      verl::reshard::run_program_cpu(src.data(), dst.data(), prog.data(), prog.size(), es);
      EXPECT(std::memcmp(dst.data(), want.data(), dst.size()) == 0);
    }
  }
}

static void test_validation_rejects() {
  auto bad = [](std::vector<Segment> p, int64_t sn, int64_t dn, int64_t align, const char* needle) {
    char msg[verl::reshard::kMessageBytes];
    const bool ok = verl::reshard::validate_program(p.data(), p.size(), sn, dn, 4, align, msg, sizeof(msg));
    if (ok || std::strstr(msg, needle) == nullptr) {
      std::fprintf(stderr, "expected an error containing '%s', got '%s'\n", needle, ok ? "(accepted)" : msg);
      ++expect_failures();
    }
  };
  bad({{0, 0, 2, 10, 10, 10}}, 15, 100, 0, "reads up to element 20");
  bad({{0, 95, 1, 10, 0, 0}}, 100, 100, 0, "writes up to element 105");
  bad({{-1, 0, 1, 1, 0, 0}}, 100, 100, 0, "every field must be in");
  bad({{0, 0, 3, 4, 4, 2}}, 100, 100, 0, "dst_stride < row_elems");
  bad({{0, 0, 1, 8, 0, 0}, {0, 7, 1, 2, 0, 0}}, 100, 100, 0, "destination ranges overlap");
  bad({{1, 0, 1, 4, 0, 0}}, 100, 100, 16, "claimed 16-byte alignment");
  std::vector<Segment> ok = {{0, 0, 2, 4, 8, 4}, {4, 8, 1, 4, 0, 0}};
  EXPECT(valid(ok, 100, 100, 4, 16));
  EXPECT(valid({}, 0, 0, 4, 0));
  // A message buffer too small for the line is truncated, never overrun.
  char tiny[8];
  std::memset(tiny, 'x', sizeof(tiny));
  std::vector<Segment> oob = {{0, 95, 1, 10, 0, 0}};
  EXPECT(!verl::reshard::validate_program(oob.data(), oob.size(), 100, 100, 4, 0, tiny, sizeof(tiny)));
  EXPECT(tiny[sizeof(tiny) - 1] == '\0');
}

int main() {
  test_unit_math();
  test_random_programs_match_reference();
  test_validation_rejects();
  if (expect_failures()) {
    std::fprintf(stderr, "%d expectation(s) failed\n", expect_failures());
    return 1;
  }
  std::printf("copy program C++ tests passed (%d threads)\n", verl::reshard::cpu_num_threads());
  return 0;
}
