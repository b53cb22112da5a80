#include "collectives/shm_group.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define VERL_CPU_RELAX() _mm_pause()
#else
#define VERL_CPU_RELAX() std::this_thread::yield()
#endif

namespace verl::collectives {
namespace {

constexpr std::size_t kLine = 64;

struct alignas(kLine) RankLine {
  std::atomic<std::uint64_t> arrived;  // calls this rank has published
  std::atomic<std::int64_t> pid;       // to tell a slow peer from a dead one
};
static_assert(sizeof(RankLine) == kLine, "one cache line per rank");
static_assert(std::atomic<std::uint64_t>::is_always_lock_free, "lock-free atomics in shared memory");

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

RankLine* lines(void* base) { return static_cast<RankLine*>(base); }

std::string errno_text() { return std::strerror(errno); }

// Gone, or a zombie its parent has not reaped yet (kill(pid, 0) still succeeds on those).
bool process_gone(pid_t pid) {
  if (kill(pid, 0) != 0) return errno == ESRCH;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  std::FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;  // no procfs: trust kill()
  char buf[512];
  const std::size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* after_name = std::strrchr(buf, ')');  // "pid (comm) S ...": comm may hold spaces
  return after_name != nullptr && (after_name[2] == 'Z' || after_name[2] == 'X');
}

}  // namespace

std::size_t ShmGroup::region_bytes(int world, std::size_t slot_bytes) {
  return kMaxRanks * kLine + 2 * static_cast<std::size_t>(world) * round_up(slot_bytes, kLine);
}

ShmGroup::ShmGroup(const std::string& name, int rank, int world, std::size_t slot_bytes, bool create)
    : name_(name), rank_(rank), world_(world), slot_bytes_(round_up(slot_bytes, kLine)) {
  if (world < 1 || world > kMaxRanks || rank < 0 || rank >= world) {
    throw std::runtime_error("shm group: expected 0 <= rank < world <= " + std::to_string(kMaxRanks) +
                             ", found rank " + std::to_string(rank) + " of " + std::to_string(world));
  }
  if (slot_bytes == 0) throw std::runtime_error("shm group: expected slot_bytes > 0, found 0");
  bytes_ = region_bytes(world, slot_bytes_);
  const int fd = create ? shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600) : shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) throw std::runtime_error("shm group: shm_open(" + name + ") failed: " + errno_text());
  // Reserve every page now: a /dev/shm too small for the region then fails here (the group falls back to
  // gloo) instead of raising SIGBUS at the first touch of a page tmpfs cannot back.
  if (create && (ftruncate(fd, static_cast<off_t>(bytes_)) != 0 ||
                 (errno = posix_fallocate(fd, 0, static_cast<off_t>(bytes_))) != 0)) {
    const std::string why = errno_text();
    close(fd);
    shm_unlink(name.c_str());
    throw std::runtime_error("shm group: reserving " + std::to_string(bytes_) + " bytes for " + name +
                             " failed: " + why);
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<std::size_t>(st.st_size) < bytes_) {
    close(fd);
    throw std::runtime_error("shm group: " + name + " is smaller than the " + std::to_string(bytes_) +
                             " bytes its group needs");
  }
  base_ = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base_ == MAP_FAILED) {
    base_ = nullptr;
    if (create) shm_unlink(name.c_str());
    throw std::runtime_error("shm group: mmap of " + name + " failed: " + errno_text());
  }
  owner_ = create;
  // A fresh object reads as zeros: every counter starts at call 0.
  lines(base_)[rank_].pid.store(static_cast<std::int64_t>(getpid()), std::memory_order_release);
}

ShmGroup::~ShmGroup() {
  if (base_ != nullptr) munmap(base_, bytes_);
}

void ShmGroup::unlink() {
  if (owner_) {
    shm_unlink(name_.c_str());
    owner_ = false;
  }
}

void* ShmGroup::slot(std::uint64_t set, int r) {
  char* slots = static_cast<char*>(base_) + kMaxRanks * kLine;
  return slots + (set * static_cast<std::size_t>(world_) + static_cast<std::size_t>(r)) * slot_bytes_;
}

void ShmGroup::arrive_and_wait(double timeout_s) {
  RankLine* all = lines(base_);
  const std::uint64_t target = call_ + 1;
  all[rank_].arrived.store(target, std::memory_order_release);
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  for (int r = 0; r < world_; ++r) {
    // Spin briefly (a peer on another core arrives within microseconds), then yield the core (ranks
    // may outnumber cores), then sleep (a peer busy elsewhere for long), checking it is still alive.
    std::uint64_t spins = 0;
    while (all[r].arrived.load(std::memory_order_acquire) < target) {
      ++spins;
      if (spins < 2000) {
        VERL_CPU_RELAX();
        continue;
      }
      const double waited = std::chrono::duration<double>(Clock::now() - start).count();
      if (waited < 0.005) {
        sched_yield();
        continue;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      if (spins % 256 != 0) continue;
      const std::int64_t pid = all[r].pid.load(std::memory_order_acquire);
      if (pid > 0 && process_gone(static_cast<pid_t>(pid))) {
        throw std::runtime_error("shm all_reduce: rank " + std::to_string(r) + " of the group (pid " +
                                 std::to_string(pid) + ") exited while rank " + std::to_string(rank_) +
                                 " waited for it");
      }
      if (waited > timeout_s) {
        throw std::runtime_error("shm all_reduce: rank " + std::to_string(rank_) + " waited " +
                                 std::to_string(static_cast<long long>(waited)) + " s for rank " +
                                 std::to_string(r) + " of the group (timeout " +
                                 std::to_string(static_cast<long long>(timeout_s)) + " s)");
      }
    }
  }
}

}  // namespace verl::collectives
