// Output files written under temporary names and renamed into place only
// when the whole run succeeded, so a failed or interrupted run never leaves a
// partial output behind.
//
// A temporary lives next to its destination (same directory, so the final
// rename is atomic): "<dir>/.<name>.<token>.ringsplash-tmp". The token (the
// creating process's id) keeps concurrent runs apart; under MPI every rank
// uses rank 0's token so all ranks write the same temporaries. Temporaries
// are removed by the destructor unless committed, and by a SIGINT/SIGTERM/
// SIGHUP handler.
#ifndef RINGSPLASH_TOOLS_PENDING_OUTPUTS_H_
#define RINGSPLASH_TOOLS_PENDING_OUTPUTS_H_

#include <cstdint>
#include <string>
#include <vector>

namespace ringsplash::cli {

// Installs the SIGINT/SIGTERM/SIGHUP handlers now. On such a signal the
// process removes its temporaries, prints "<command>: interrupted by SIGINT"
// (or SIGTERM, SIGHUP) on stderr and dies of the signal: exit status
// 128 + signal (130 for Ctrl-C). A PendingOutputs owner installs them with
// its first temporary if nothing did before, silently: under mpirun, which
// stops every rank with SIGTERM once one rank fails, a rank's "interrupted"
// would hide the real error. Idempotent: the first call's command stays.
void InstallSignalHandlers(const char* command);

class PendingOutputs {
 public:
  // `owner`: this process removes and renames the temporaries (under MPI
  // only rank 0 owns them; the others just write into them).
  PendingOutputs(uint64_t token, bool owner);
  ~PendingOutputs();
  PendingOutputs(const PendingOutputs&) = delete;
  PendingOutputs& operator=(const PendingOutputs&) = delete;

  // Registers `final_path` and returns its temporary path. Throws Error if
  // the destination is a directory.
  std::string Add(const std::string& final_path);
  // Renames every temporary onto its destination (owner only).
  void Commit();

 private:
  struct Entry {
    std::string final_path, temp_path;
  };
  uint64_t token_;
  bool owner_;
  bool committed_ = false;
  std::vector<Entry> entries_;
};

}  // namespace ringsplash::cli

#endif  // RINGSPLASH_TOOLS_PENDING_OUTPUTS_H_
