// What staging cost, per collective, for comm.stats(): one table for the process.
#include <chrono>

#include "staging.h"

namespace comm_native {
namespace {

std::mutex tallyMutex;
std::map<std::string, Tally>& tallyTable() {
  static std::map<std::string, Tally> table;
  return table;
}

} // namespace

void tally(const std::string& name, const Tally& more) {
  std::lock_guard<std::mutex> lock(tallyMutex);
  auto& entry = tallyTable()[name];
  entry.calls += more.calls;
  entry.transfers += more.transfers;
  entry.bytes += more.bytes;
  entry.nanoseconds += more.nanoseconds;
}

std::map<std::string, Tally> tallies() {
  std::lock_guard<std::mutex> lock(tallyMutex);
  return tallyTable();
}

void resetTallies() {
  std::lock_guard<std::mutex> lock(tallyMutex);
  tallyTable().clear();
}

int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

} // namespace comm_native
