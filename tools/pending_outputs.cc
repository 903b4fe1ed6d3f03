// Temporary output files, their commit by rename, and their removal on
// error or on a terminating signal.
#include "tools/pending_outputs.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <iterator>

#include "ringsplash/error.h"

namespace ringsplash::cli {
namespace {

// Paths the signal handler unlinks. Fixed storage: a handler may not
// allocate. Slots are claimed with an atomic counter and cleared (first byte
// zero) once a temporary is renamed or removed.
constexpr int kMaxTemps = 32;
constexpr size_t kMaxPath = 4096;
char g_temp_paths[kMaxTemps][kMaxPath];
std::atomic<int> g_temp_count{0};
std::atomic<bool> g_handlers_installed{false};

// The stderr line per signal ("ringsplash attend: interrupted by SIGINT"),
// composed when the handlers are installed: the handler only write()s it.
constexpr int kSignals[] = {SIGINT, SIGTERM, SIGHUP};
constexpr const char* kSignalNames[] = {"SIGINT", "SIGTERM", "SIGHUP"};
constexpr size_t kMaxMessage = 256;
char g_messages[std::size(kSignals)][kMaxMessage];
size_t g_message_sizes[std::size(kSignals)];

void OnSignal(int sig) {
  const int n = g_temp_count.load();
  for (int i = 0; i < n && i < kMaxTemps; ++i) {
    if (g_temp_paths[i][0] != '\0') ::unlink(g_temp_paths[i]);
  }
  for (size_t i = 0; i < std::size(kSignals); ++i) {
    if (kSignals[i] != sig) continue;
    // write() is async-signal-safe; stdio is not. Nothing to do if it fails.
    const ssize_t written = ::write(STDERR_FILENO, g_messages[i], g_message_sizes[i]);
    (void)written;
  }
  // Die of the signal itself: the exit status is 128 + sig, as shells expect.
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

// Installs the handlers once; `command` (if not null) sets the line they
// print, whether or not an output was tracked first.
void InstallHandlers(const char* command) {
  if (command != nullptr) {
    // On a terminal a progress line may be showing (progress.h): clear it.
    const char* clear = ::isatty(STDERR_FILENO) == 1 ? "\r\033[K" : "";
    for (size_t i = 0; i < std::size(kSignals); ++i) {
      std::snprintf(g_messages[i], kMaxMessage, "%s%s: interrupted by %s\n", clear, command,
                    kSignalNames[i]);
      g_message_sizes[i] = std::strlen(g_messages[i]);
    }
  }
  if (g_handlers_installed.exchange(true)) return;
  for (int sig : kSignals) std::signal(sig, OnSignal);
}

void Track(const std::string& path) {
  InstallHandlers(nullptr);
  const int i = g_temp_count.fetch_add(1);
  Check(i < kMaxTemps && path.size() < kMaxPath, "too many or too long output paths");
  std::memcpy(g_temp_paths[i], path.c_str(), path.size() + 1);
}

void Untrack(const std::string& path) {
  const int n = g_temp_count.load();
  for (int i = 0; i < n && i < kMaxTemps; ++i) {
    if (path == g_temp_paths[i]) g_temp_paths[i][0] = '\0';
  }
}

}  // namespace

void InstallSignalHandlers(const char* command) { InstallHandlers(command); }

PendingOutputs::PendingOutputs(uint64_t token, bool owner) : token_(token), owner_(owner) {}

PendingOutputs::~PendingOutputs() {
  if (!owner_ || committed_) return;
  for (const Entry& e : entries_) {
    ::unlink(e.temp_path.c_str());
    Untrack(e.temp_path);
  }
}

std::string PendingOutputs::Add(const std::string& final_path) {
  struct stat st {};
  Check(!(::stat(final_path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)), final_path,
        ": is a directory; expected an output file name");
  const size_t slash = final_path.rfind('/');
  const std::string dir = slash == std::string::npos ? "" : final_path.substr(0, slash + 1);
  const std::string base = slash == std::string::npos ? final_path : final_path.substr(slash + 1);
  // Checked here so the message names the user's path, not the temporary.
  Check(::access(dir.empty() ? "." : dir.c_str(), W_OK | X_OK) == 0, final_path,
        ": cannot create: ", std::strerror(errno));
  Entry e{final_path, dir + "." + base + "." + std::to_string(token_) + ".ringsplash-tmp"};
  if (owner_) Track(e.temp_path);
  entries_.push_back(e);
  return e.temp_path;
}

void PendingOutputs::Commit() {
  if (!owner_) return;
  for (const Entry& e : entries_) {
    if (std::rename(e.temp_path.c_str(), e.final_path.c_str()) != 0) {
      Fail(e.final_path, ": cannot move the finished output into place: ", std::strerror(errno));
    }
    Untrack(e.temp_path);
  }
  committed_ = true;
}

}  // namespace ringsplash::cli
