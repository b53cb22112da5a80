// A shared-memory rendezvous for the ranks of one process group on one host: the fast path of
// verl's CPU all-reduce (gloo pays ~2 ms per collective on a small host, whatever the size; a
// shared-memory round is a few microseconds plus the bytes).
//
// Layout of the region: one cache line per rank holding its arrival counter and pid, then two sets
// of `world` slots of `slot_bytes` each. A call writes its chunk into slot (set = call parity, rank),
// bumps its counter (release), waits until every counter reached the call number (acquire), then
// reads every rank's slot. Two sets make one wait per call enough: a rank writing set s at call k
// has seen every rank arrive at call k-1, which each did after reading set s at call k-2.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace verl::collectives {

constexpr int kMaxRanks = 256;

class ShmGroup {
 public:
  // create: make the named POSIX shared-memory object (it must not exist) sized for `world` ranks;
  // otherwise open the one another rank made. Throws std::runtime_error naming what failed.
  ShmGroup(const std::string& name, int rank, int world, std::size_t slot_bytes, bool create);
  ~ShmGroup();
  ShmGroup(const ShmGroup&) = delete;
  ShmGroup& operator=(const ShmGroup&) = delete;

  // Removes the name (the mapping stays valid in every rank that opened it): call once all opened.
  void unlink();

  int rank() const { return rank_; }
  int world() const { return world_; }
  std::size_t slot_bytes() const { return slot_bytes_; }

  // The slot this rank writes next, and the one rank `r` wrote, for the current call.
  void* my_slot() { return slot(call_ & 1, rank_); }
  const void* slot_of(int r) { return slot(call_ & 1, r); }

  // Publish my slot and wait for every rank's; throws std::runtime_error when a peer process is
  // gone or `timeout_s` passes first. Afterwards slot_of(r) is valid until the next arrive_and_wait.
  void arrive_and_wait(double timeout_s);
  // Ends the call whose slots were just read (the next call uses the other set).
  void finish() { ++call_; }

  static std::size_t region_bytes(int world, std::size_t slot_bytes);

 private:
  void* slot(std::uint64_t set, int r);

  std::string name_;
  int rank_;
  int world_;
  std::size_t slot_bytes_;
  std::size_t bytes_;
  void* base_ = nullptr;
  bool owner_ = false;
  std::uint64_t call_ = 0;
};

}  // namespace verl::collectives
