// C++ tests of the shared-memory rendezvous behind verl's CPU collectives (run by ctest): forked ranks
// exchange many rounds through their slots (both slot sets, every value checked), a rank whose peer
// exited raises instead of waiting, and bad arguments are refused.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

#include "collectives/shm_group.h"
#include "tests/expect.h"

using verl::collectives::ShmGroup;


static std::string unique_name(const char* what) {
  return "/verl_shm_test_" + std::string(what) + "_" + std::to_string(getpid());
}

// Each rank writes (round, rank, i) into its slot; after the rendezvous it checks every rank's slot.
static int exchange_rounds(const std::string& name, int rank, int world, int rounds) {
  ShmGroup group(name, rank, world, 4096, false);
  const std::size_t n = group.slot_bytes() / sizeof(int64_t);
  for (int round = 0; round < rounds; ++round) {
    auto* mine = static_cast<int64_t*>(group.my_slot());
    for (std::size_t i = 0; i < n; ++i) mine[i] = (static_cast<int64_t>(round) << 32) | (rank << 16) | i;
    group.arrive_and_wait(30.0);
    for (int r = 0; r < world; ++r) {
      const auto* theirs = static_cast<const int64_t*>(group.slot_of(r));
      for (std::size_t i = 0; i < n; ++i) {
        if (theirs[i] != ((static_cast<int64_t>(round) << 32) | (r << 16) | static_cast<int64_t>(i))) return 1;
      }
    }
    group.finish();
  }
  return 0;
}

static void test_ranks_exchange_many_rounds(int world) {
  const std::string name = unique_name("rounds");
  ShmGroup owner(name, 0, world, 4096, true);
  pid_t children[8];
  for (int r = 1; r < world; ++r) {
    children[r] = fork();
    if (children[r] == 0) _exit(exchange_rounds(name, r, world, 500));
  }
  // Rank 0 runs in this process through a second mapping of the same region.
  int status = exchange_rounds(name, 0, world, 500);
  EXPECT(status == 0);
  owner.unlink();
  for (int r = 1; r < world; ++r) {
    int child_status = 0;
    waitpid(children[r], &child_status, 0);
    EXPECT(WIFEXITED(child_status) && WEXITSTATUS(child_status) == 0);
  }
}

static void test_exited_peer_raises() {
  const std::string name = unique_name("dead");
  ShmGroup group(name, 0, 2, 64, true);
  pid_t child = fork();
  if (child == 0) {
    ShmGroup peer(name, 1, 2, 64, false);  // records its pid, then leaves without arriving
    _exit(0);
  }
  int status = 0;
  waitpid(child, &status, 0);
  bool raised = false;
  try {
    group.arrive_and_wait(30.0);
  } catch (const std::runtime_error& err) {
    raised = std::strstr(err.what(), "exited") != nullptr;
  }
  EXPECT(raised);
  group.unlink();
}

static void test_bad_arguments_are_refused() {
  bool raised = false;
  try {
    ShmGroup group(unique_name("bad"), 2, 2, 64, true);
  } catch (const std::runtime_error&) {
    raised = true;
  }
  EXPECT(raised);
  raised = false;
  try {
    ShmGroup group(unique_name("missing"), 0, 2, 64, false);  // nobody created it
  } catch (const std::runtime_error& err) {
    raised = std::strstr(err.what(), "shm_open") != nullptr;
  }
  EXPECT(raised);
  raised = false;
  const std::string huge = unique_name("huge");
  try {
    ShmGroup group(huge, 0, 2, std::size_t{1} << 40, true);  // 4 TiB: more than any /dev/shm holds
  } catch (const std::runtime_error& err) {
    raised = std::strstr(err.what(), "reserving") != nullptr;
  }
  EXPECT(raised);
  raised = false;
  try {
    ShmGroup group(huge, 0, 2, 64, false);  // the failed region was removed, not left behind
  } catch (const std::runtime_error&) {
    raised = true;
  }
  EXPECT(raised);
}

int main() {
  test_ranks_exchange_many_rounds(2);
  test_ranks_exchange_many_rounds(3);
  test_exited_peer_raises();
  test_bad_arguments_are_refused();
  if (expect_failures() == 0) std::printf("shm group: all tests passed\n");
  return expect_failures() == 0 ? 0 : 1;
}
