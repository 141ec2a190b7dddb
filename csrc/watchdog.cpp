#include "watchdog.h"

#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

namespace fastpar {
namespace {

struct Dog {
  std::mutex mu;
  std::condition_variable cv;
  bool disarmed = false;
};

std::mutex registry_mu;
std::map<int64_t, std::shared_ptr<Dog>> registry;
int64_t next_id = 1;

// Remove the name of every file this process maps whose path starts with `prefix`; the memory
// stays with whoever maps it. A line of /proc/self/maps ends with the path, where its first
// '/' is.
void unlink_mapped(const std::string& prefix) {
  if (prefix.empty()) return;
  std::FILE* maps = std::fopen("/proc/self/maps", "r");
  if (maps == nullptr) return;
  static const char kDeleted[] = " (deleted)";
  char line[8192];
  while (std::fgets(line, sizeof line, maps) != nullptr) {
    char* path = std::strchr(line, '/');
    if (path == nullptr) continue;
    size_t len = std::strcspn(path, "\n");
    path[len] = '\0';
    size_t tail = sizeof kDeleted - 1;
    if (len >= tail && std::strcmp(path + len - tail, kDeleted) == 0) continue;  // gone already
    if (std::strncmp(path, prefix.c_str(), prefix.size()) == 0) ::unlink(path);
  }
  std::fclose(maps);
}

}  // namespace

int64_t watchdog_arm(double seconds, const std::string& message, int64_t exit_code,
                     const std::string& unlink_prefix) {
  auto dog = std::make_shared<Dog>();
  int64_t id;
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    id = next_id++;
    registry[id] = dog;
  }
  // The thread holds its own copy of everything it touches, so it may outlive the caller.
  std::thread([dog, seconds, message, exit_code, unlink_prefix] {
    std::unique_lock<std::mutex> lock(dog->mu);
    auto deadline = std::chrono::steady_clock::now() +
                    std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                        std::chrono::duration<double>(seconds));
    if (dog->cv.wait_until(lock, deadline, [&] { return dog->disarmed; })) return;
    unlink_mapped(unlink_prefix);
    std::string line = message + "\n";
    ssize_t ignored = ::write(2, line.data(), line.size());
    (void)ignored;
    ::_exit(static_cast<int>(exit_code));
  }).detach();
  return id;
}

bool watchdog_disarm(int64_t id) {
  std::shared_ptr<Dog> dog;
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    auto it = registry.find(id);
    if (it == registry.end()) return false;
    dog = it->second;
    registry.erase(it);
  }
  {
    std::lock_guard<std::mutex> lock(dog->mu);
    dog->disarmed = true;
  }
  dog->cv.notify_all();
  return true;
}

}  // namespace fastpar
