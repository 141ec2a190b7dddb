#pragma once
// A process-exit watchdog for blocking calls that hold the Python GIL and have no timeout of
// their own (MPI_Init waits forever for a rank that never started). Pure C++, no torch.
#include <cstdint>
#include <string>

namespace fastpar {
// Arm: unless disarmed within `seconds`, write `message` to stderr and _exit(exit_code), having
// first removed the name of every file this process maps under `unlink_prefix` (none when
// empty): MPI_Init's shared memory, which a job that never came together leaves named.
// Returns an id for watchdog_disarm.
int64_t watchdog_arm(double seconds, const std::string& message, int64_t exit_code,
                     const std::string& unlink_prefix = "");
// Disarm; returns false if `id` is unknown or already disarmed (a watchdog that fired has
// already ended the process).
bool watchdog_disarm(int64_t id);
}  // namespace fastpar
