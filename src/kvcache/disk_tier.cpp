#include "kvcache/disk_tier.h"

#include <dirent.h>
#include <fcntl.h>
#include <liburing.h>
#include <linux/openat2.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <stdexcept>
#include <thread>

#include <spdlog/spdlog.h>

#include "kvcache/disk_format.h"

namespace di::kvcache {

namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kNsPerSec = 1'000'000'000;

int64_t unix_ns_now() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return int64_t(ts.tv_sec) * kNsPerSec + ts.tv_nsec;
}
int64_t ns_of(const timespec& ts) { return int64_t(ts.tv_sec) * kNsPerSec + ts.tv_nsec; }
int64_t steady_ns() { return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count(); }

void set_thread_name(const char* name) { pthread_setname_np(pthread_self(), name); }

long sys_openat2(int dirfd, const char* path, uint64_t flags, uint64_t resolve) {
  open_how how{};
  how.flags = flags;
  how.resolve = resolve;
  return syscall(SYS_openat2, dirfd, path, &how, sizeof how);
}
constexpr uint64_t kResolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;

// Calls fn(name) for each directory entry of `dirfd` (not . and ..); the fd stays open.
template <class F>
void for_each_name(int dirfd, F&& fn) {
  const int fd = dup(dirfd);
  if (fd < 0) return;
  DIR* d = fdopendir(fd);
  if (!d) {
    close(fd);
    return;
  }
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.' && (e->d_name[1] == 0 || (e->d_name[1] == '.' && e->d_name[2] == 0))) continue;
    if (!fn(static_cast<const char*>(e->d_name))) break;
  }
  closedir(d);
}

}  // namespace

// Types that DiskTier::Impl names (kept out of the anonymous namespace for that reason).
namespace disk_impl {

// A cursor over an iovec list consumed by partial reads or writes.
struct IovCursor {
  std::vector<iovec> iov;
  size_t idx = 0;
  void skip_empty() {
    while (idx < iov.size() && iov[idx].iov_len == 0) ++idx;
  }
  void advance(size_t n) {
    while (n > 0 && idx < iov.size()) {
      if (n >= iov[idx].iov_len) {
        n -= iov[idx].iov_len;
        ++idx;
      } else {
        iov[idx].iov_base = static_cast<char*>(iov[idx].iov_base) + n;
        iov[idx].iov_len -= n;
        n = 0;
      }
    }
    skip_empty();
  }
  bool done() const { return idx >= iov.size(); }
  iovec* cur() { return iov.data() + idx; }
  int count() const { return int(std::min<size_t>(iov.size() - idx, IOV_MAX)); }
};

struct WriteJob {
  EntryKey key;
  std::vector<std::span<const std::byte>> parts;
  std::shared_ptr<const void> owner;
  uint64_t bytes = 0;
};

enum class ReadEnd {
  Missing,  // no such file
  Skip,     // a miss that leaves the file alone (larger than this process reads)
  Error,    // an I/O error: a miss, the file is left alone
  Bad,      // short, corrupt, foreign, mis-sized, not a regular file: a miss, removed
  Read,     // read whole: verified next
};

struct ReadReq {
  EntryKey key;
  std::string rel;
  bool blob = false;
  std::vector<std::span<std::byte>> dest;
  std::shared_ptr<void> owner;
  std::promise<bool> done;
  std::promise<std::optional<std::vector<std::byte>>> done_blob;
  Clock::time_point t0;
  int fd = -1;
  uint64_t file_size = 0;
  dev_t dev = 0;
  ino_t ino = 0;
  int64_t atime_ns = 0;
  std::vector<std::byte> header, blob_buf;
  IovCursor cur;
  uint64_t got = 0;
  // io_uring state
  int stage = 0;
  open_how how{};
  struct statx stx{};
};

class ReaderBackend {
 public:
  virtual ~ReaderBackend() = default;
  virtual void submit(std::unique_ptr<ReadReq>) = 0;
  virtual void shutdown() = 0;
};

}  // namespace disk_impl

using namespace disk_impl;

struct DiskTier::Impl {
  explicit Impl(DiskTierOptions o);
  ~Impl();

  DiskTierOptions opt;
  int dirfd = -1;
  size_t hdr_bytes = 0;
  bool have_openat2 = false;
  // Reads open with O_NOATIME: the tier sets access times itself, and a kernel atime update on
  // read (relatime updates when atime <= mtime) would defeat atime_refresh. Only the owner (or
  // CAP_FOWNER) may use it; the first EPERM turns it off.
  mutable std::atomic<bool> noatime{true};
  DiskTierOptions::Reader reader_kind = DiskTierOptions::Reader::Pread;

  std::atomic<uint64_t> hits{0}, hit_bytes{0}, misses{0}, corrupt_removed{0}, read_errors{0}, pending_hits{0};
  std::atomic<uint64_t> writes{0}, write_bytes{0}, writes_dropped{0}, writes_existing{0}, write_errors{0};
  std::atomic<uint64_t> evictions{0}, expirations{0}, temps_removed{0}, sweeps{0};
  std::atomic<int64_t> est_bytes{0}, est_entries{0};
  std::atomic<int64_t> published_bytes{0}, published_entries{0};  // by this process, ever
  std::atomic<uint64_t> read_ns{0}, write_ns{0};
  std::atomic<int64_t> queued_reads{0};
  std::atomic<bool> index_ready{false};

  // Disk-full degradation.
  std::mutex full_mu;
  std::atomic<int64_t> full_until_ns{INT64_MIN};  // steady clock
  bool full_logged = false;
  std::atomic<int64_t> last_error_log_ns{0};  // steady clock; 0 = never
  // At most one error line a minute (a failing disk would otherwise log every read).
  bool error_log_due() {
    const int64_t now = steady_ns();
    int64_t last = last_error_log_ns.load();
    return (last == 0 || now - last > 60 * kNsPerSec) && last_error_log_ns.compare_exchange_strong(last, now);
  }

  // Writers.
  std::mutex wmu;
  std::condition_variable wcv, wdone;
  std::deque<WriteJob> wq;
  // Queued or being written, with the payload: this process reads an entry it has not published
  // yet from memory, so a request right behind the write (the next turn of a chat) still hits.
  struct Pending {
    std::vector<std::span<const std::byte>> parts;
    std::shared_ptr<const void> owner;
  };
  std::map<EntryKey, Pending> wkeys;
  uint64_t wbytes = 0;       // queued or being written
  int writing = 0;
  bool wstop = false;
  std::vector<std::thread> writers;

  // Sweeper.
  std::mutex smu;
  std::condition_variable scv;
  bool sweep_requested = false;
  std::atomic<bool> sstop{false};
  std::mutex pass_mu;
  std::thread sweeper;

  std::unique_ptr<ReaderBackend> reader;

  bool disk_full_now() const { return steady_ns() < full_until_ns.load(std::memory_order_relaxed); }
  int open_subdir(int index, bool create) const;
  int open_entry(const std::string& rel) const;
  void remove_bad(const EntryKey&, int fd);

  // Reads (both backends).
  bool start_read(ReadReq&, const struct stat&);
  void end_read(std::unique_ptr<ReadReq>, ReadEnd, int err = 0);
  void read_sync(std::unique_ptr<ReadReq>);

  // Writes.
  bool enqueue(WriteJob);
  void writer_loop();
  void write_one(const WriteJob&);
  void write_failed(const char* what, int err, int subfd, const std::string& tmp);

  // Sweeps.
  void sweeper_loop();
  void request_sweep();
  void pass();
  void sub_estimate(int64_t bytes, int64_t entries);
};

namespace {

// A pool of threads doing open + fstat + preadv + verify, one read at a time each.
class PreadPool final : public ReaderBackend {
 public:
  PreadPool(DiskTier::Impl& t, int threads) : t_(t) {
    for (int i = 0; i < threads; ++i) th_.emplace_back([this] { run(); });
  }
  ~PreadPool() override { shutdown(); }
  void submit(std::unique_ptr<ReadReq> r) override {
    std::unique_lock lk(mu_);
    if (stop_) {
      lk.unlock();
      t_.end_read(std::move(r), ReadEnd::Skip);
      return;
    }
    q_.push_back(std::move(r));
    cv_.notify_one();
  }
  void shutdown() override {
    {
      std::lock_guard lk(mu_);
      if (stop_ && th_.empty()) return;
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : th_) t.join();
    th_.clear();
    for (auto& r : q_) t_.end_read(std::move(r), ReadEnd::Skip);
    q_.clear();
  }

 private:
  void run() {
    set_thread_name("kv-disk-read");
    for (;;) {
      std::unique_ptr<ReadReq> r;
      {
        std::unique_lock lk(mu_);
        cv_.wait(lk, [&] { return stop_ || !q_.empty(); });
        if (stop_) return;  // what is left completes as misses in shutdown()
        r = std::move(q_.front());
        q_.pop_front();
      }
      t_.read_sync(std::move(r));
    }
  }
  DiskTier::Impl& t_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<ReadReq>> q_;
  bool stop_ = false;
  std::vector<std::thread> th_;
};

// io_uring readers: each ring has one thread that keeps up to `depth` reads in flight, each going
// openat2 → statx → readv (repeated on short reads) through the ring; verification runs on the
// ring's thread. An eventfd read in the ring wakes the thread for new requests.
class UringRing {
 public:
  UringRing(DiskTier::Impl& t, int depth) : t_(t), depth_(depth) {}
  ~UringRing() {
    stop();
    if (ring_ok_) io_uring_queue_exit(&ring_);
    if (efd_ >= 0) close(efd_);
  }
  // False (with *why) when the kernel does not offer what the reader needs.
  bool init(std::string* why) {
    const int rc = io_uring_queue_init(unsigned(2 * depth_ + 2), &ring_, 0);
    if (rc < 0) {
      *why = std::string("io_uring_queue_init: ") + std::strerror(-rc);
      return false;
    }
    ring_ok_ = true;
    io_uring_probe* probe = io_uring_get_probe_ring(&ring_);
    const bool ops = probe && io_uring_opcode_supported(probe, IORING_OP_OPENAT2) &&
                     io_uring_opcode_supported(probe, IORING_OP_STATX) &&
                     io_uring_opcode_supported(probe, IORING_OP_READV) && io_uring_opcode_supported(probe, IORING_OP_READ);
    if (probe) io_uring_free_probe(probe);
    if (!ops) {
      *why = "io_uring lacks openat2/statx/readv";
      return false;
    }
    efd_ = eventfd(0, EFD_CLOEXEC);
    if (efd_ < 0) {
      *why = std::string("eventfd: ") + std::strerror(errno);
      return false;
    }
    return true;
  }
  void start() {
    th_ = std::thread([this] { run(); });
  }
  void submit(std::unique_ptr<ReadReq> r) {
    {
      std::unique_lock lk(mu_);
      if (stop_) {
        lk.unlock();
        t_.end_read(std::move(r), ReadEnd::Skip);
        return;
      }
      q_.push_back(std::move(r));
    }
    wake();
  }
  void stop() {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    if (th_.joinable()) {
      wake();
      th_.join();
    }
    for (auto& r : q_) t_.end_read(std::move(r), ReadEnd::Skip);
    q_.clear();
  }

 private:
  enum Stage { kOpen = 1, kStat, kRead };
  static constexpr uint64_t kWakeTag = 0;

  void wake() {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(efd_, &one, sizeof one);
  }
  io_uring_sqe* sqe() {
    io_uring_sqe* s = io_uring_get_sqe(&ring_);
    while (!s) {
      io_uring_submit(&ring_);
      s = io_uring_get_sqe(&ring_);
    }
    return s;
  }
  void arm_wake() {
    io_uring_sqe* s = sqe();
    io_uring_prep_read(s, efd_, &efd_buf_, sizeof efd_buf_, 0);
    io_uring_sqe_set_data64(s, kWakeTag);
  }
  void prep_open(ReadReq* r) {
    r->stage = kOpen;
    r->how = {};
    r->how.flags = O_RDONLY | O_CLOEXEC | (t_.noatime.load(std::memory_order_relaxed) ? O_NOATIME : 0);
    r->how.resolve = kResolve;
    io_uring_sqe* s = sqe();
    io_uring_prep_openat2(s, t_.dirfd, r->rel.c_str(), &r->how);
    io_uring_sqe_set_data(s, r);
  }
  void prep_read(ReadReq* r) {
    r->stage = kRead;
    io_uring_sqe* s = sqe();
    io_uring_prep_readv(s, r->fd, r->cur.cur(), unsigned(r->cur.count()), r->got);
    io_uring_sqe_set_data(s, r);
  }
  void finish(ReadReq* r, ReadEnd end, int err = 0) {
    --inflight_;
    t_.end_read(std::unique_ptr<ReadReq>(r), end, err);
  }
  void on_cqe(ReadReq* r, int res) {
    switch (r->stage) {
      case kOpen:
        if (res == -EPERM && (r->how.flags & O_NOATIME)) {
          t_.noatime = false;
          return prep_open(r);
        }
        if (res < 0) {
          // ELOOP/EXDEV: a symlink on the path, which the tier never makes.
          finish(r, res == -ENOENT ? ReadEnd::Missing : (res == -ELOOP || res == -EXDEV) ? ReadEnd::Bad : ReadEnd::Error, -res);
          return;
        }
        r->fd = res;
        r->stage = kStat;
        {
          io_uring_sqe* s = sqe();
          io_uring_prep_statx(s, r->fd, "", AT_EMPTY_PATH, STATX_TYPE | STATX_SIZE | STATX_ATIME | STATX_INO, &r->stx);
          io_uring_sqe_set_data(s, r);
        }
        return;
      case kStat: {
        if (res < 0) return finish(r, ReadEnd::Error, -res);
        struct stat st{};
        st.st_mode = r->stx.stx_mode;
        st.st_size = off_t(r->stx.stx_size);
        st.st_ino = r->stx.stx_ino;
        st.st_dev = makedev(r->stx.stx_dev_major, r->stx.stx_dev_minor);
        st.st_atim.tv_sec = r->stx.stx_atime.tv_sec;
        st.st_atim.tv_nsec = r->stx.stx_atime.tv_nsec;
        if (!t_.start_read(*r, st)) return finish(r, r->stage == -1 ? ReadEnd::Skip : ReadEnd::Bad);
        return prep_read(r);
      }
      case kRead:
        if (res == -EINTR || res == -EAGAIN) return prep_read(r);
        if (res < 0) return finish(r, ReadEnd::Error, -res);
        if (res == 0) return finish(r, ReadEnd::Bad);  // shorter than its stat said: truncated meanwhile
        r->got += uint64_t(res);
        r->cur.advance(size_t(res));
        if (r->cur.done()) return finish(r, ReadEnd::Read);
        return prep_read(r);
    }
  }
  void run() {
    set_thread_name("kv-disk-uring");
    arm_wake();
    for (;;) {
      bool stopping;
      {
        std::lock_guard lk(mu_);
        stopping = stop_;
        while (!stopping && inflight_ < depth_ && !q_.empty()) {
          ReadReq* r = q_.front().release();
          q_.pop_front();
          ++inflight_;
          prep_open(r);
        }
      }
      // On stop the reads in flight finish (the kernel writes into their buffers); queued ones
      // complete as misses in stop().
      if (stopping && inflight_ == 0) return;
      const int rc = io_uring_submit_and_wait(&ring_, 1);
      if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
        spdlog::error("kv disk tier: io_uring_submit_and_wait: {}", std::strerror(-rc));
      }
      unsigned head, n = 0;
      io_uring_cqe* c;
      std::vector<std::pair<uint64_t, int>> done;
      io_uring_for_each_cqe(&ring_, head, c) {
        done.emplace_back(c->user_data, c->res);
        ++n;
      }
      io_uring_cq_advance(&ring_, n);
      for (auto [tag, res] : done) {
        if (tag == kWakeTag) {
          arm_wake();
        } else {
          on_cqe(reinterpret_cast<ReadReq*>(tag), res);
        }
      }
    }
  }

  DiskTier::Impl& t_;
  const int depth_;
  io_uring ring_{};
  bool ring_ok_ = false;
  int efd_ = -1;
  uint64_t efd_buf_ = 0;
  int inflight_ = 0;  // ring thread only
  std::mutex mu_;
  std::deque<std::unique_ptr<ReadReq>> q_;
  bool stop_ = false;
  std::thread th_;
};

class UringReader final : public ReaderBackend {
 public:
  explicit UringReader(std::vector<std::unique_ptr<UringRing>> rings) : rings_(std::move(rings)) {
    for (auto& r : rings_) r->start();
  }
  ~UringReader() override { shutdown(); }
  void submit(std::unique_ptr<ReadReq> r) override {
    rings_[next_.fetch_add(1, std::memory_order_relaxed) % rings_.size()]->submit(std::move(r));
  }
  void shutdown() override {
    for (auto& r : rings_) r->stop();
  }

 private:
  std::vector<std::unique_ptr<UringRing>> rings_;
  std::atomic<size_t> next_{0};
};

}  // namespace

// ---- construction ----

DiskTier::Impl::Impl(DiskTierOptions o) : opt(std::move(o)) {
  if (opt.dir.empty()) throw std::invalid_argument("disk tier: no directory");
  if (opt.format_id.empty() || opt.format_id.size() > disk::kMaxFormatIdBytes)
    throw std::invalid_argument("disk tier: the format id must have 1 to 1024 bytes");
  if (opt.io_threads < 1 || opt.write_threads < 1 || opt.uring_depth < 1)
    throw std::invalid_argument("disk tier: io_threads, write_threads and uring_depth must be at least 1");
  if (!(opt.low_watermark > 0 && opt.low_watermark <= 1))
    throw std::invalid_argument("disk tier: low_watermark must be in (0, 1]");
  std::error_code ec;
  std::filesystem::create_directories(opt.dir, ec);
  dirfd = ::open(opt.dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dirfd < 0) throw std::runtime_error("disk tier: cannot open directory " + opt.dir + ": " + std::strerror(errno));
  hdr_bytes = disk::header_bytes(opt.format_id);
  const long probe = sys_openat2(dirfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC, kResolve);
  have_openat2 = probe >= 0;
  if (probe >= 0) close(int(probe));

  if (opt.reader == DiskTierOptions::Reader::IoUring) {
    std::string why = have_openat2 ? "" : "no openat2";
    std::vector<std::unique_ptr<UringRing>> rings;
    for (int i = 0; have_openat2 && i < opt.io_threads; ++i) {
      auto ring = std::make_unique<UringRing>(*this, opt.uring_depth);
      if (!ring->init(&why)) {
        rings.clear();
        break;
      }
      rings.push_back(std::move(ring));
    }
    if (!rings.empty()) {
      reader = std::make_unique<UringReader>(std::move(rings));
      reader_kind = DiskTierOptions::Reader::IoUring;
    } else {
      spdlog::warn("kv disk tier: io_uring reader unavailable ({}); using the pread pool", why);
    }
  }
  if (!reader) reader = std::make_unique<PreadPool>(*this, opt.io_threads);
  for (int i = 0; i < opt.write_threads; ++i) writers.emplace_back([this] { writer_loop(); });
  sweeper = std::thread([this] { sweeper_loop(); });
}

DiskTier::Impl::~Impl() {
  {
    std::lock_guard lk(smu);
    sstop = true;
  }
  scv.notify_all();
  if (sweeper.joinable()) sweeper.join();
  {
    std::lock_guard lk(wmu);
    wstop = true;
    writes_dropped += wq.size();
    wq.clear();
  }
  wcv.notify_all();
  for (auto& w : writers) w.join();
  reader->shutdown();
  reader.reset();
  close(dirfd);
}

// ---- paths ----

int DiskTier::Impl::open_subdir(int index, bool create) const {
  const std::string name = disk::subdir_name(index);
  if (create && mkdirat(dirfd, name.c_str(), 0755) != 0 && errno != EEXIST) return -1;
  // O_NOFOLLOW: a symlink in place of a subdirectory would lead outside the tier's directory.
  return openat(dirfd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
}

int DiskTier::Impl::open_entry(const std::string& rel) const {
  for (;;) {
    const bool na = noatime.load(std::memory_order_relaxed);
    const int flags = O_RDONLY | O_CLOEXEC | (na ? O_NOATIME : 0);
    int fd;
    if (have_openat2) {
      fd = int(sys_openat2(dirfd, rel.c_str(), uint64_t(flags), kResolve));
    } else {
      const size_t slash = rel.find('/');
      const int sub = openat(dirfd, rel.substr(0, slash).c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (sub < 0) return -1;
      fd = openat(sub, rel.c_str() + slash + 1, flags | O_NOFOLLOW);
      const int err = errno;
      close(sub);
      errno = err;
    }
    if (fd < 0 && errno == EPERM && na) {
      noatime = false;
      continue;
    }
    return fd;
  }
}

void DiskTier::Impl::sub_estimate(int64_t bytes, int64_t entries) {
  est_bytes.fetch_sub(bytes, std::memory_order_relaxed);
  est_entries.fetch_sub(entries, std::memory_order_relaxed);
}

// Removes the entry's file if it is still the one `fd` has open (another process may have
// published a good file under the name since), or, with fd < 0, if it is not a regular file.
void DiskTier::Impl::remove_bad(const EntryKey& key, int fd) {
  const int sub = open_subdir(disk::subdir_index(key), false);
  if (sub < 0) return;
  const std::string name = disk::key_hex(key) + std::string(disk::kEntrySuffix);
  struct stat named {};
  if (fstatat(sub, name.c_str(), &named, AT_SYMLINK_NOFOLLOW) == 0) {
    bool same;
    if (fd >= 0) {
      struct stat open_st {};
      same = fstat(fd, &open_st) == 0 && open_st.st_dev == named.st_dev && open_st.st_ino == named.st_ino;
    } else {
      same = !S_ISREG(named.st_mode) && !S_ISDIR(named.st_mode);
    }
    if (same && unlinkat(sub, name.c_str(), 0) == 0) {
      ++corrupt_removed;
      if (S_ISREG(named.st_mode)) sub_estimate(named.st_size, 1);
    }
  }
  close(sub);
}

// ---- reads ----

// Sets up the iovecs for a file of st.st_size bytes; false when that size cannot be this entry's
// (r.stage = -1 marks a file left alone: larger than max_entry_bytes).
bool DiskTier::Impl::start_read(ReadReq& r, const struct stat& st) {
  r.file_size = uint64_t(st.st_size);
  r.dev = st.st_dev;
  r.ino = st.st_ino;
  r.atime_ns = ns_of(st.st_atim);
  if (!S_ISREG(st.st_mode) || r.file_size < hdr_bytes) return false;
  const uint64_t payload = r.file_size - hdr_bytes;
  r.header.resize(hdr_bytes);
  r.cur.iov.clear();
  r.cur.iov.push_back({r.header.data(), r.header.size()});
  if (r.blob) {
    if (r.file_size > opt.max_entry_bytes) {
      r.stage = -1;
      return false;
    }
    r.blob_buf.resize(payload);
    r.cur.iov.push_back({r.blob_buf.data(), r.blob_buf.size()});
  } else {
    uint64_t want = 0;
    for (auto& d : r.dest) want += d.size();
    if (want != payload) return false;
    for (auto& d : r.dest) r.cur.iov.push_back({d.data(), d.size()});
  }
  r.cur.idx = 0;
  r.cur.skip_empty();
  r.got = 0;
  return true;
}

void DiskTier::Impl::end_read(std::unique_ptr<ReadReq> r, ReadEnd end, int err) {
  bool hit = false;
  if (end == ReadEnd::Read) {
    uint64_t want_hash = 0;
    const disk::HeaderCheck c = disk::check_header(r->header, r->key, opt.format_id, r->file_size - hdr_bytes, &want_hash);
    if (c == disk::HeaderCheck::Ok) {
      disk::PayloadHash h;
      if (r->blob) {
        h.update(r->blob_buf);
      } else {
        for (auto& d : r->dest) h.update(d);
      }
      hit = h.digest() == want_hash;
      if (!hit) spdlog::debug("kv disk tier: {}: payload checksum mismatch", r->rel);
    } else {
      spdlog::debug("kv disk tier: {}: {}", r->rel, disk::header_check_name(c));
    }
    if (!hit) end = ReadEnd::Bad;
  }
  if (end == ReadEnd::Bad) remove_bad(r->key, r->fd);
  if (end == ReadEnd::Error) {
    ++read_errors;
    if (error_log_due())
      spdlog::warn("kv disk tier: reading {}: {} (a miss)", r->rel, std::strerror(err));
  }
  if (hit) {
    // Explicitly, so that LRU works on noatime/relatime mounts.
    const int64_t now = unix_ns_now();
    if (now - r->atime_ns >= std::chrono::duration_cast<std::chrono::nanoseconds>(opt.atime_refresh).count()) {
      const timespec times[2] = {{0, UTIME_NOW}, {0, UTIME_OMIT}};
      futimens(r->fd, times);
    }
  }
  if (r->fd >= 0) close(r->fd);
  r->fd = -1;
  const uint64_t payload = hit ? r->file_size - hdr_bytes : 0;
  if (hit) {
    ++hits;
    hit_bytes += payload;
  } else {
    ++misses;
  }
  read_ns += uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - r->t0).count());
  --queued_reads;
  if (r->blob) {
    r->done_blob.set_value(hit ? std::optional(std::move(r->blob_buf)) : std::nullopt);
  } else {
    r->done.set_value(hit);
  }
}

void DiskTier::Impl::read_sync(std::unique_ptr<ReadReq> r) {
  r->fd = open_entry(r->rel);
  if (r->fd < 0) {
    const int e = errno;
    return end_read(std::move(r), e == ENOENT ? ReadEnd::Missing : (e == ELOOP || e == EXDEV) ? ReadEnd::Bad : ReadEnd::Error, e);
  }
  struct stat st {};
  if (fstat(r->fd, &st) != 0) return end_read(std::move(r), ReadEnd::Error, errno);
  if (!start_read(*r, st)) return end_read(std::move(r), r->stage == -1 ? ReadEnd::Skip : ReadEnd::Bad);
  while (!r->cur.done()) {
    const ssize_t n = preadv(r->fd, r->cur.cur(), r->cur.count(), off_t(r->got));
    if (n < 0) {
      if (errno == EINTR) continue;
      return end_read(std::move(r), ReadEnd::Error, errno);
    }
    if (n == 0) return end_read(std::move(r), ReadEnd::Bad);  // truncated since the fstat
    r->got += uint64_t(n);
    r->cur.advance(size_t(n));
  }
  end_read(std::move(r), ReadEnd::Read);
}

// ---- writes ----

bool DiskTier::Impl::enqueue(WriteJob j) {
  for (auto& p : j.parts) j.bytes += p.size();
  if (j.bytes + hdr_bytes > opt.max_entry_bytes || disk_full_now()) {
    ++writes_dropped;
    return false;
  }
  {
    std::lock_guard lk(wmu);
    if (wstop || wbytes + j.bytes > opt.max_queued_write_bytes || wkeys.contains(j.key)) {
      ++writes_dropped;
      return false;
    }
    wbytes += j.bytes;
    wkeys.emplace(j.key, Pending{j.parts, j.owner});
    wq.push_back(std::move(j));
  }
  wcv.notify_one();
  return true;
}

void DiskTier::Impl::writer_loop() {
  set_thread_name("kv-disk-write");
  for (;;) {
    WriteJob j;
    {
      std::unique_lock lk(wmu);
      wcv.wait(lk, [&] { return wstop || !wq.empty(); });
      if (wstop) return;
      j = std::move(wq.front());
      wq.pop_front();
      ++writing;
    }
    if (disk_full_now()) {
      ++writes_dropped;
    } else {
      write_one(j);
    }
    j.owner.reset();
    {
      std::lock_guard lk(wmu);
      --writing;
      wbytes -= j.bytes;
      wkeys.erase(j.key);
    }
    wdone.notify_all();
  }
}

void DiskTier::Impl::write_failed(const char* what, int err, int subfd, const std::string& tmp) {
  if (subfd >= 0 && !tmp.empty()) unlinkat(subfd, tmp.c_str(), 0);
  if (err == ENOSPC || err == EDQUOT) {
    std::lock_guard lk(full_mu);
    const int64_t now = steady_ns();
    if (now >= full_until_ns.load()) {
      spdlog::warn("kv disk tier: {} in {} ({}): no disk writes for {} s; reads go on", std::strerror(err), opt.dir, what,
                   double(opt.full_backoff.count()) / 1000.0);
      full_logged = true;
    }
    full_until_ns = now + std::chrono::duration_cast<std::chrono::nanoseconds>(opt.full_backoff).count();
    ++writes_dropped;
    return;
  }
  ++write_errors;
  if (error_log_due())
    spdlog::warn("kv disk tier: writing in {} ({}): {}", opt.dir, what, std::strerror(err));
}

void DiskTier::Impl::write_one(const WriteJob& j) {
  const auto t0 = Clock::now();
  const std::string hex = disk::key_hex(j.key);
  const std::string final_name = hex + std::string(disk::kEntrySuffix);
  const std::string rel = disk::subdir_name(disk::subdir_index(j.key)) + "/" + final_name;
  struct stat st {};
  if (fstatat(dirfd, rel.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
    ++writes_existing;
    return;
  }
  const int sub = open_subdir(disk::subdir_index(j.key), true);
  if (sub < 0) return write_failed("creating its subdirectory", errno, -1, "");
  // Unique across threads, processes and machines sharing the directory; O_EXCL makes sure.
  thread_local std::mt19937_64 rng{std::random_device{}() ^ (uint64_t(getpid()) << 32) ^ uint64_t(gettid())};
  char suffix[64];
  std::snprintf(suffix, sizeof suffix, "-%d-%d-%016llx", int(getpid()), int(gettid()), (unsigned long long)rng());
  const std::string tmp = std::string(disk::kTempPrefix) + hex + suffix;
  const int fd = openat(sub, tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) {
    const int e = errno;
    close(sub);
    return write_failed("creating a temp file", e, -1, "");
  }
  auto fail = [&](const char* what, int e, bool fd_open) {
    if (fd_open) close(fd);
    write_failed(what, e, sub, tmp);
    close(sub);
  };
  disk::PayloadHash h;
  for (auto& p : j.parts) h.update(p);
  std::vector<std::byte> header(hdr_bytes);
  disk::encode_header(header, j.key, opt.format_id, j.bytes, h.digest(), uint64_t(unix_ns_now() / 1'000'000));
  IovCursor cur;
  cur.iov.push_back({header.data(), header.size()});
  for (auto& p : j.parts) cur.iov.push_back({const_cast<std::byte*>(p.data()), p.size()});
  cur.skip_empty();
  off_t off = 0;
  while (!cur.done()) {
    const ssize_t n = pwritev(fd, cur.cur(), cur.count(), off);
    if (n < 0) {
      if (errno == EINTR) continue;
      return fail("writing", errno, true);
    }
    off += n;
    cur.advance(size_t(n));
  }
  if (opt.fsync && fdatasync(fd) != 0) return fail("fsync", errno, true);
  // Network file systems report deferred write errors at close.
  if (close(fd) != 0) return fail("closing", errno, false);
  if (renameat(sub, tmp.c_str(), sub, final_name.c_str()) != 0) return fail("renaming", errno, false);
  if (opt.fsync_dir) fsync(sub);
  close(sub);
  ++writes;
  write_bytes += j.bytes;
  write_ns += uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
  est_entries.fetch_add(1, std::memory_order_relaxed);
  published_entries.fetch_add(1, std::memory_order_relaxed);
  published_bytes.fetch_add(int64_t(hdr_bytes + j.bytes), std::memory_order_relaxed);
  const int64_t total = est_bytes.fetch_add(int64_t(hdr_bytes + j.bytes), std::memory_order_relaxed) + int64_t(hdr_bytes + j.bytes);
  {
    std::lock_guard lk(full_mu);
    if (full_logged) {
      full_logged = false;
      spdlog::info("kv disk tier: disk writes resumed in {}", opt.dir);
    }
  }
  if (uint64_t(std::max<int64_t>(total, 0)) > opt.capacity_bytes) request_sweep();
}

// ---- sweeps ----

void DiskTier::Impl::request_sweep() {
  {
    std::lock_guard lk(smu);
    sweep_requested = true;
  }
  scv.notify_one();
}

void DiskTier::Impl::sweeper_loop() {
  set_thread_name("kv-disk-sweep");
  for (;;) {
    pass();  // the first pass is the index rebuild after a start
    std::unique_lock lk(smu);
    scv.wait_for(lk, opt.sweep_interval, [&] { return sstop.load() || sweep_requested; });
    if (sstop) return;
    sweep_requested = false;
  }
}

// One pass over the directory: stale temps, TTL expiry, then (over capacity) least recently
// accessed entries down to the low watermark. The eviction order is kept as a histogram of access
// times in whole seconds, so a pass needs memory per distinct second, not per file; a second scan
// removes what is older than the cut-off. Every removal is decided on a fresh stat, so an entry
// another process refreshed since the first scan stays.
void DiskTier::Impl::pass() {
  std::lock_guard pl(pass_mu);
  // Entries this process publishes during the scan may or may not be seen by it: they are added
  // to the result, so the estimate errs high (and an extra pass corrects it), never low.
  const int64_t pub_bytes0 = published_bytes, pub_entries0 = published_entries;
  const int64_t now = unix_ns_now();
  const int64_t ttl_cut = now - std::chrono::duration_cast<std::chrono::nanoseconds>(opt.ttl).count();
  const int64_t temp_cut = now - std::chrono::duration_cast<std::chrono::nanoseconds>(opt.temp_grace).count();
  std::map<int64_t, uint64_t> by_second;
  uint64_t total = 0, entries = 0;
  EntryKey key;
  for (int i = 0; i < 256; ++i) {
    if (sstop) return;
    const int sub = open_subdir(i, false);
    if (sub < 0) continue;
    for_each_name(sub, [&](const char* name) {
      if (sstop) return false;
      struct stat st {};
      if (disk::is_temp_name(name)) {
        if (fstatat(sub, name, &st, AT_SYMLINK_NOFOLLOW) == 0 && ns_of(st.st_mtim) < temp_cut && unlinkat(sub, name, 0) == 0)
          ++temps_removed;
      } else if (disk::parse_entry_name(name, &key)) {
        if (fstatat(sub, name, &st, AT_SYMLINK_NOFOLLOW) != 0) return true;  // removed meanwhile
        if (!S_ISREG(st.st_mode)) {
          if (!S_ISDIR(st.st_mode) && unlinkat(sub, name, 0) == 0) ++corrupt_removed;
          return true;
        }
        const int64_t atime = std::min(ns_of(st.st_atim), now);
        if (atime < ttl_cut) {
          if (unlinkat(sub, name, 0) == 0) ++expirations;
          return true;
        }
        total += uint64_t(st.st_size);
        ++entries;
        by_second[atime / kNsPerSec] += uint64_t(st.st_size);
      }
      return true;
    });
    close(sub);
  }
  if (total > opt.capacity_bytes) {
    const uint64_t target = uint64_t(double(opt.capacity_bytes) * opt.low_watermark);
    const uint64_t need = total - target;
    uint64_t below = 0;
    int64_t cut_sec = INT64_MAX;
    for (auto [sec, bytes] : by_second) {
      if (below + bytes >= need) {
        cut_sec = sec;
        break;
      }
      below += bytes;
    }
    const uint64_t at_cut_budget = need - below;  // bytes to take from the cut-off second itself
    uint64_t at_cut_freed = 0, freed = 0, removed = 0;
    for (int i = 0; i < 256 && !sstop; ++i) {
      const int sub = open_subdir(i, false);
      if (sub < 0) continue;
      for_each_name(sub, [&](const char* name) {
        if (sstop) return false;
        struct stat st {};
        if (!disk::parse_entry_name(name, &key) || fstatat(sub, name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode))
          return true;
        const int64_t sec = std::min(ns_of(st.st_atim), now) / kNsPerSec;
        const bool older = sec < cut_sec;
        if (!older && !(sec == cut_sec && at_cut_freed < at_cut_budget)) return true;
        const int rc = unlinkat(sub, name, 0);
        if (rc == 0) ++evictions;
        if (rc == 0 || errno == ENOENT) {  // ENOENT: another process's sweeper took it
          freed += uint64_t(st.st_size);
          ++removed;
          if (!older) at_cut_freed += uint64_t(st.st_size);
        }
        return true;
      });
      close(sub);
    }
    total -= std::min(total, freed);
    entries -= std::min(entries, removed);
  }
  est_bytes = int64_t(total) + (published_bytes - pub_bytes0);
  est_entries = int64_t(entries) + (published_entries - pub_entries0);
  index_ready = true;
  // Over capacity only through writes made during the scan: look again (without writes, the pass
  // itself got below the watermark or could not, and another pass would not either).
  if (published_bytes != pub_bytes0 && uint64_t(est_bytes.load()) > opt.capacity_bytes && !sstop) request_sweep();
  ++sweeps;
}

// ---- the public class ----

DiskTier::DiskTier(DiskTierOptions o) : impl_(std::make_unique<Impl>(std::move(o))) {}
DiskTier::~DiskTier() = default;

bool DiskTier::write_async(const EntryKey& key, std::vector<std::span<const std::byte>> parts, std::shared_ptr<const void> owner) {
  WriteJob j;
  j.key = key;
  j.parts = std::move(parts);
  j.owner = std::move(owner);
  return impl_->enqueue(std::move(j));
}

bool DiskTier::contains(const EntryKey& key) const {
  {
    std::lock_guard lk(impl_->wmu);
    if (impl_->wkeys.contains(key)) return true;
  }
  struct stat st {};
  return fstatat(impl_->dirfd, disk::entry_relpath(key).c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode) &&
         uint64_t(st.st_size) >= impl_->hdr_bytes;
}

std::future<bool> DiskTier::read_async(const EntryKey& key, std::vector<std::span<std::byte>> dest, std::shared_ptr<void> owner) {
  auto r = std::make_unique<ReadReq>();
  r->key = key;
  r->rel = disk::entry_relpath(key);
  r->dest = std::move(dest);
  r->owner = std::move(owner);
  r->t0 = Clock::now();
  auto f = r->done.get_future();
  ++impl_->queued_reads;
  impl_->reader->submit(std::move(r));
  return f;
}

std::future<std::optional<std::vector<std::byte>>> DiskTier::read_blob_async(const EntryKey& key) {
  Impl::Pending p;
  {
    std::lock_guard lk(impl_->wmu);
    if (auto it = impl_->wkeys.find(key); it != impl_->wkeys.end()) p = it->second;
  }
  if (p.owner) {
    // Not published yet: the queued payload (kept alive by its owner) is the entry.
    std::vector<std::byte> blob;
    for (const auto& part : p.parts) blob.insert(blob.end(), part.begin(), part.end());
    ++impl_->hits;
    ++impl_->pending_hits;
    impl_->hit_bytes += blob.size();
    std::promise<std::optional<std::vector<std::byte>>> done;
    done.set_value(std::move(blob));
    return done.get_future();
  }
  auto r = std::make_unique<ReadReq>();
  r->key = key;
  r->rel = disk::entry_relpath(key);
  r->blob = true;
  r->t0 = Clock::now();
  auto f = r->done_blob.get_future();
  ++impl_->queued_reads;
  impl_->reader->submit(std::move(r));
  return f;
}

void DiskTier::flush() {
  std::unique_lock lk(impl_->wmu);
  impl_->wdone.wait(lk, [&] { return impl_->wq.empty() && impl_->writing == 0; });
}

uint64_t DiskTier::clear() {
  Impl& t = *impl_;
  {
    std::unique_lock lk(t.wmu);
    for (auto& j : t.wq) {
      t.wbytes -= j.bytes;
      t.wkeys.erase(j.key);
    }
    t.writes_dropped += t.wq.size();
    t.wq.clear();
    t.wdone.wait(lk, [&] { return t.writing == 0; });
  }
  std::lock_guard pl(t.pass_mu);
  const int64_t pub_bytes0 = t.published_bytes, pub_entries0 = t.published_entries;
  uint64_t removed = 0;
  EntryKey key;
  for (int i = 0; i < 256; ++i) {
    const int sub = t.open_subdir(i, false);
    if (sub < 0) continue;
    for_each_name(sub, [&](const char* name) {
      struct stat st {};
      if (disk::parse_entry_name(name, &key) && fstatat(sub, name, &st, AT_SYMLINK_NOFOLLOW) == 0 && !S_ISDIR(st.st_mode) &&
          unlinkat(sub, name, 0) == 0) {
        ++removed;
      }
      return true;
    });
    close(sub);
  }
  // Empty now but for what this process published meanwhile (errs high, as a pass does).
  t.est_bytes = t.published_bytes - pub_bytes0;
  t.est_entries = t.published_entries - pub_entries0;
  return removed;
}

void DiskTier::sweep_now() { impl_->pass(); }

DiskTierStats DiskTier::stats() const {
  const Impl& t = *impl_;
  DiskTierStats s;
  s.hits = t.hits;
  s.pending_hits = t.pending_hits;
  s.hit_bytes = t.hit_bytes;
  s.misses = t.misses;
  s.corrupt_removed = t.corrupt_removed;
  s.read_errors = t.read_errors;
  s.writes = t.writes;
  s.write_bytes = t.write_bytes;
  s.writes_dropped = t.writes_dropped;
  s.writes_existing = t.writes_existing;
  s.write_errors = t.write_errors;
  s.evictions = t.evictions;
  s.expirations = t.expirations;
  s.temps_removed = t.temps_removed;
  s.sweeps = t.sweeps;
  s.bytes_on_disk = uint64_t(std::max<int64_t>(t.est_bytes, 0));
  s.entries_on_disk = uint64_t(std::max<int64_t>(t.est_entries, 0));
  {
    std::lock_guard lk(const_cast<std::mutex&>(t.wmu));
    s.queued_writes = t.wq.size() + uint64_t(t.writing);
    s.queued_write_bytes = t.wbytes;
  }
  s.queued_reads = uint64_t(std::max<int64_t>(t.queued_reads, 0));
  s.read_seconds = double(t.read_ns) * 1e-9;
  s.write_seconds = double(t.write_ns) * 1e-9;
  s.disk_full = t.disk_full_now();
  s.index_ready = t.index_ready;
  s.reader = t.reader_kind;
  return s;
}

std::string DiskTier::entry_path(const EntryKey& key) const { return impl_->opt.dir + "/" + disk::entry_relpath(key); }

const DiskTierOptions& DiskTier::options() const { return impl_->opt; }

}  // namespace di::kvcache
