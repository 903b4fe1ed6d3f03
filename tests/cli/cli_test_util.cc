// Scratch directories and command execution for the CLI tests.
#include "tests/cli/cli_test_util.h"

#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "tools/npy.h"

namespace ringsplash::testing {
namespace {

std::string Quote(const std::string& word) {
  std::string q = "'";
  for (char c : word) {
    if (c == '\'') {
      q.append("'\\''");
    } else {
      q.push_back(c);
    }
  }
  q.push_back('\'');
  return q;
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

}  // namespace

ScratchDir::ScratchDir() {
  const char* base = std::getenv("TMPDIR");
  std::string templ = std::string(base && *base ? base : "/tmp") + "/ringsplash-cli-XXXXXX";
  if (::mkdtemp(templ.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  path_ = templ;
}

ScratchDir::~ScratchDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

std::vector<std::string> ScratchDir::List() const {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(path_)) {
    names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

CommandResult RunCommand(const std::vector<std::string>& argv, int timeout_s,
                         const std::string& cwd) {
  ScratchDir capture;
  std::ostringstream cmd;
  if (!cwd.empty()) cmd << "cd " << Quote(cwd) << " && ";
  cmd << "timeout -k 5 " << timeout_s;
  for (const std::string& a : argv) cmd << ' ' << Quote(a);
  cmd << " >" << Quote(capture / "out") << " 2>" << Quote(capture / "err") << " </dev/null";
  const int raw = std::system(cmd.str().c_str());
  CommandResult r;
  if (raw != -1 && WIFEXITED(raw)) r.status = WEXITSTATUS(raw);
  if (raw != -1 && WIFSIGNALED(raw)) r.status = 128 + WTERMSIG(raw);
  r.out = Slurp(capture / "out");
  r.err = Slurp(capture / "err");
  return r;
}

CommandResult RunCli(const std::vector<std::string>& args, int timeout_s) {
  std::vector<std::string> argv = {RINGSPLASH_CLI};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunCommand(argv, timeout_s);
}

#ifdef RINGSPLASH_MPIEXEC
CommandResult RunCliUnderMpi(int ranks, const std::vector<std::string>& args, int timeout_s,
                             const std::vector<std::string>& env) {
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  std::vector<std::string> argv = {"env"};
  argv.insert(argv.end(), env.begin(), env.end());
  argv.insert(argv.end(), {RINGSPLASH_MPIEXEC, "--oversubscribe", "-np", std::to_string(ranks),
                           RINGSPLASH_CLI});
  argv.insert(argv.end(), args.begin(), args.end());
  return RunCommand(argv, timeout_s);
}
#endif

#if defined(__linux__)
OneCpu::OneCpu() {
  CPU_ZERO(&saved_);
  ok_ = sched_getaffinity(0, sizeof(saved_), &saved_) == 0;
  if (!ok_) return;
  cpu_set_t one;
  CPU_ZERO(&one);
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &saved_)) {
      CPU_SET(c, &one);
      break;
    }
  }
  ok_ = sched_setaffinity(0, sizeof(one), &one) == 0;
}

OneCpu::~OneCpu() {
  if (ok_) sched_setaffinity(0, sizeof(saved_), &saved_);
}
#endif

int CountLines(const std::string& text) {
  if (text.empty()) return 0;
  const int n = static_cast<int>(std::count(text.begin(), text.end(), '\n'));
  return text.back() == '\n' ? n : n + 1;
}

std::vector<double> ReadF32(const std::string& path, std::vector<int64_t>* shape) {
  const npy::NpyArray a = npy::NpyArray::Open(path);
  if (a.type() != npy::NpyType::kF32) throw std::runtime_error(path + ": not float32");
  *shape = a.shape();
  std::vector<float> f(static_cast<size_t>(a.numel()));
  std::memcpy(f.data(), a.data(), f.size() * sizeof(float));
  return std::vector<double>(f.begin(), f.end());
}

}  // namespace ringsplash::testing
