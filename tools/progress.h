// A one-line "what is running, for how long" indicator on stderr.
//
// Shown only when stderr is a terminal (never in logs or pipes) and only
// once a phase has run for more than two seconds; the line is cleared when
// the phase changes or the indicator is destroyed.
#ifndef RINGSPLASH_TOOLS_PROGRESS_H_
#define RINGSPLASH_TOOLS_PROGRESS_H_

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

namespace ringsplash::cli {

class Progress {
 public:
  // `prefix` starts every line (e.g. "ringsplash attend"). `enabled` false
  // (e.g. on MPI ranks other than 0) silences it regardless of the terminal.
  Progress(std::string prefix, bool enabled);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // Starts a new phase ("forward", "writing outputs").
  void Phase(const std::string& name);

 private:
  void Loop();
  void ClearLocked();

  std::string prefix_;
  bool enabled_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool shown_ = false;
  std::string phase_;
  std::chrono::steady_clock::time_point phase_start_;
  std::thread thread_;
};

}  // namespace ringsplash::cli

#endif  // RINGSPLASH_TOOLS_PROGRESS_H_
