// Starts `deepinfer serve` as a child process for end-to-end tests, on a generated tiny model.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <regex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "model/v41/tiny_generator.h"
#include "server_test_util.h"

namespace di::test {

// A tiny V4.1 model generated once per build directory. Test processes run in parallel, so each
// generates into its own directory and renames it into place; the first rename wins.
inline std::string e2e_model_dir() {
  namespace fs = std::filesystem;
  const std::string dir = std::string(DI_BINARY_DIR) + "/e2e-models/tiny";
  if (fs::exists(dir + "/config.json")) return dir;
  const std::string tmp = dir + ".tmp." + std::to_string(::getpid());
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  v41::TinyOptions o;
  o.size = "tiny";
  o.seed = 0;
  v41::make_tiny_checkpoint(o, tmp);
  std::error_code ec;
  if (!fs::exists(dir + "/config.json")) {
    fs::remove_all(dir, ec);  // an interrupted earlier generation
    fs::rename(tmp, dir, ec);
  }
  fs::remove_all(tmp, ec);
  return dir;
}

// Runs a shell command, returning its exit status and output.
inline int run_command(const std::string& cmd, std::string& output) {
  output.clear();
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return -1;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) output.append(buf, n);
  const int st = pclose(p);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

// Node and the npm `openai` module must exist: a missing one fails the test (never a silent skip).
inline std::string node_problem() {
  std::string out;
  if (run_command("node --version", out) != 0) return "node is not installed (run scripts/setup)";
  const std::string mod = std::string(DI_SOURCE_DIR) + "/third_party/npm/node_modules/openai/package.json";
  if (!std::filesystem::exists(mod)) return mod + " is missing (run scripts/setup)";
  return "";
}

class ServerProcess {
 public:
  explicit ServerProcess(const std::vector<std::string>& args) {
    int fds[2];
    if (pipe(fds) != 0) throw std::runtime_error("pipe failed");
    pid_ = fork();
    if (pid_ == 0) {
      dup2(fds[1], 1);
      dup2(fds[1], 2);
      close(fds[0]);
      close(fds[1]);
      std::vector<std::string> full = {std::string(DI_BINARY_DIR) + "/deepinfer", "serve"};
      full.insert(full.end(), args.begin(), args.end());
      std::vector<char*> argv;
      for (auto& a : full) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      std::perror("execv");
      _exit(127);
    }
    close(fds[1]);
    fd_ = fds[0];
    reader_ = std::thread([this] {
      char buf[4096];
      ssize_t n;
      while ((n = read(fd_, buf, sizeof buf)) > 0) {
        std::lock_guard lk(mu_);
        log_.append(buf, size_t(n));
      }
    });
    // The listener comes up before the model loads: read the port from the log.
    const std::regex listening(R"(listening on http://\S*:(\d+) )");
    for (int i = 0; i < 600 && port_ == 0; ++i) {
      {
        std::lock_guard lk(mu_);
        std::smatch m;
        if (std::regex_search(log_, m, listening)) port_ = uint16_t(std::stoi(m[1]));
      }
      if (port_ == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (port_ == 0) throw std::runtime_error("server did not start listening; log:\n" + log());
  }
  ~ServerProcess() {
    stop();
    if (reader_.joinable()) reader_.join();
    if (fd_ >= 0) close(fd_);
  }
  // Polls /health until 200 (503 while loading).
  bool wait_healthy(int seconds) {
    bool saw_loading = false;
    for (int i = 0; i < seconds * 20; ++i) {
      try {
        auto r = fetch(port_, "GET", "/health");
        if (r.status == 200) return true;
        if (r.status == 503) saw_loading = true;
      } catch (const std::exception&) {
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    (void)saw_loading;
    return false;
  }
  // SIGTERM and wait; returns the exit status.
  int stop() {
    if (pid_ <= 0) return exit_status_;
    kill(pid_, SIGTERM);
    int st = 0;
    for (int i = 0; i < 300; ++i) {
      if (waitpid(pid_, &st, WNOHANG) == pid_) {
        pid_ = -1;
        exit_status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        return exit_status_;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    kill(pid_, SIGKILL);
    waitpid(pid_, &st, 0);
    pid_ = -1;
    exit_status_ = 137;
    return exit_status_;
  }
  uint16_t port() const { return port_; }
  pid_t pid() const { return pid_; }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  std::string log() const {
    std::lock_guard lk(mu_);
    return log_;
  }
  // Resident set size of the server (kB), from /proc.
  long rss_kb() const {
    std::ifstream f("/proc/" + std::to_string(pid_) + "/status");
    std::string line;
    while (std::getline(f, line))
      if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
    return -1;
  }

 private:
  pid_t pid_ = -1;
  int fd_ = -1;
  uint16_t port_ = 0;
  int exit_status_ = -1;
  mutable std::mutex mu_;
  std::string log_;
  std::thread reader_;
};

// Samples of a /metrics body as name{labels} -> value.
inline std::map<std::string, double> parse_metrics(const std::string& body) {
  std::map<std::string, double> out;
  std::istringstream in(body);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t sp = line.rfind(' ');
    out[line.substr(0, sp)] = std::stod(line.substr(sp + 1));
  }
  return out;
}

}  // namespace di::test
