// Terminal-only elapsed-time indicator.
#include "tools/progress.h"

#include <unistd.h>

#include <cstdio>

namespace ringsplash::cli {
namespace {
constexpr double kShowAfterSeconds = 2.0;
constexpr auto kRefresh = std::chrono::milliseconds(250);
}  // namespace

Progress::Progress(std::string prefix, bool enabled)
    : prefix_(std::move(prefix)),
      enabled_(enabled && ::isatty(STDERR_FILENO) == 1),
      phase_start_(std::chrono::steady_clock::now()) {
  if (enabled_) thread_ = std::thread([this] { Loop(); });
}

Progress::~Progress() {
  if (!enabled_) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    ClearLocked();
  }
  cv_.notify_all();
  thread_.join();
}

void Progress::Phase(const std::string& name) {
  if (!enabled_) return;
  std::lock_guard<std::mutex> lock(mu_);
  ClearLocked();
  phase_ = name;
  phase_start_ = std::chrono::steady_clock::now();
}

void Progress::ClearLocked() {
  if (!shown_) return;
  std::fputs("\r\033[K", stderr);
  std::fflush(stderr);
  shown_ = false;
}

void Progress::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, kRefresh);
    if (stop_ || phase_.empty()) continue;
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - phase_start_).count();
    if (s < kShowAfterSeconds) continue;
    std::fprintf(stderr, "\r\033[K%s: %s ... %.0f s", prefix_.c_str(), phase_.c_str(), s);
    std::fflush(stderr);
    shown_ = true;
  }
}

}  // namespace ringsplash::cli
