// Local-disk blob store (contract in kdn/disk_store.h).
#include "kdn/disk_store.h"

#include "kdn/codec.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

namespace fs = std::filesystem;

namespace kdn {
namespace {

constexpr const char* kSuffix = ".kdnb";
constexpr uint64_t kMaxBlobFileBytes = 1ull << 36;

std::string key_hex(const Key128& key) {
  static const char digits[] = "0123456789abcdef";
  std::string out(32, '0');
  for (int i = 0; i < 16; ++i) {
    out[2 * i] = digits[key[i] >> 4];
    out[2 * i + 1] = digits[key[i] & 15];
  }
  return out;
}

bool key_from_hex(const std::string& hex, Key128* key) {
  if (hex.size() != 32) return false;
  for (int i = 0; i < 32; ++i) {
    char c = hex[i];
    int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (v < 0) return false;
    (*key)[i / 2] = static_cast<uint8_t>(i % 2 == 0 ? v << 4 : ((*key)[i / 2] | v));
  }
  return true;
}

std::string errno_text(const std::string& what, const std::string& path) {
  return what + " " + path + ": " + std::strerror(errno);
}

bool write_all(int fd, const uint8_t* data, size_t size) {
  while (size > 0) {
    ssize_t n = ::write(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

// Reads a whole blob file; nullptr with *missing set if it does not exist, or with *error set.
BufferPtr read_file(const std::string& path, bool* missing, std::string* error) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT || errno == ENOTDIR) *missing = true;
    else *error = errno_text("cannot open", path);
    return nullptr;
  }
  struct stat st;
  BufferPtr buf;
  if (::fstat(fd, &st) != 0) {
    *error = errno_text("cannot stat", path);
  } else if (st.st_size <= 0 || static_cast<uint64_t>(st.st_size) > kMaxBlobFileBytes) {
    *error = "blob file " + path + " has an impossible size " + std::to_string(st.st_size);
  } else {
    buf = std::make_shared<Buffer>(static_cast<size_t>(st.st_size));
    size_t done = 0;
    while (done < buf->size()) {
      ssize_t n = ::pread(fd, buf->data() + done, buf->size() - done, static_cast<off_t>(done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        *error = n == 0 ? "blob file " + path + " shrank while being read" : errno_text("cannot read", path);
        buf.reset();
        break;
      }
      done += static_cast<size_t>(n);
    }
  }
  ::close(fd);
  return buf;
}

}  // namespace

DiskStore::DiskStore(DiskStoreOptions options)
    : options_(std::move(options)),
      index_(options_.capacity_bytes, options_.policy),
      readers_(std::max(1, options_.read_threads)) {
  KDN_CHECK_INPUT(!options_.dir.empty(), "DiskStore: the directory is empty");
  KDN_CHECK_INPUT(options_.capacity_bytes > 0, "DiskStore: capacity_bytes must be positive");
  std::error_code ec;
  fs::create_directories(fs::path(options_.dir) / "tmp", ec);
  if (ec) throw InputError("DiskStore: cannot create " + options_.dir + ": " + ec.message(), __FILE__, __LINE__);
  remove_stale_temporaries();
  rebuild_index();
  writer_ = std::thread([this] { writer_loop(); });
}

DiskStore::~DiskStore() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  queue_cv_.notify_all();
  writer_.join();
}

std::string DiskStore::path_of(const Key128& key) const {
  std::string hex = key_hex(key);
  return options_.dir + "/" + hex.substr(0, 2) + "/" + hex + kSuffix;
}

void DiskStore::remove_stale_temporaries() {
  std::error_code ec;
  for (fs::directory_iterator it(fs::path(options_.dir) / "tmp", ec), end; !ec && it != end; it.increment(ec)) {
    std::string name = it->path().filename().string();  // <hex>.<pid>.<n>.tmp
    size_t a = name.find('.'), b = a == std::string::npos ? a : name.find('.', a + 1);
    if (b == std::string::npos) continue;
    long pid = std::strtol(name.substr(a + 1, b - a - 1).c_str(), nullptr, 10);
    if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      std::error_code ignored;
      fs::remove(it->path(), ignored);
    }
  }
}

void DiskStore::rebuild_index() {
  struct Found {
    fs::file_time_type mtime;
    Key128 key;
    uint64_t bytes;
  };
  std::vector<Found> found;
  std::error_code ec;
  for (fs::directory_iterator shard(options_.dir, ec), end; !ec && shard != end; shard.increment(ec)) {
    if (shard->path().filename().string().size() != 2) continue;
    std::error_code ec2;
    for (fs::directory_iterator f(shard->path(), ec2); !ec2 && f != end; f.increment(ec2)) {
      std::string name = f->path().filename().string();
      Key128 key;
      if (name.size() != 32 + std::strlen(kSuffix) || name.substr(32) != kSuffix || !key_from_hex(name.substr(0, 32), &key))
        continue;
      std::error_code ec3;
      uint64_t bytes = f->file_size(ec3);
      auto mtime = f->last_write_time(ec3);
      if (!ec3) found.push_back({mtime, key, bytes});
    }
  }
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) { return a.mtime < b.mtime; });
  std::vector<Key128> victims;
  for (const auto& f : found) adopt_locked(f.key, f.bytes, &victims);  // oldest first: newest survive
  unlink_keys(victims);
}

bool DiskStore::adopt_locked(const Key128& key, uint64_t bytes, std::vector<Key128>* victims) {
  if (index_.contains(key)) return true;
  size_t before = victims->size();
  if (!index_.make_room(bytes, victims)) return false;
  stats_.evictions += victims->size() - before;
  index_.insert(key, bytes);
  ++stats_.adopted;
  return true;
}

void DiskStore::unlink_keys(const std::vector<Key128>& keys) {
  for (const auto& key : keys) ::unlink(path_of(key).c_str());
}

void DiskStore::record_error(const std::string& error) {
  ++stats_.errors;
  stats_.last_error = error;
}

bool DiskStore::write_file(const Key128& key, const BufferPtr& blob, std::string* error) {
  if (inject_failures_.load() > 0 && inject_failures_.fetch_sub(1) > 0) {
    *error = "injected write failure (No space left on device)";
    return false;
  }
  std::string hex = key_hex(key);
  std::string final_path = path_of(key);
  std::string tmp_dir = options_.dir + "/tmp";
  std::string tmp_path = tmp_dir + "/" + hex + "." + std::to_string(::getpid()) + "." +
                         std::to_string(tmp_counter_.fetch_add(1)) + ".tmp";
  std::error_code ec;
  fs::create_directories(tmp_dir, ec);
  fs::create_directories(options_.dir + "/" + hex.substr(0, 2), ec);
  if (ec) {
    *error = "cannot create directories under " + options_.dir + ": " + ec.message();
    return false;
  }
  int fd = ::open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    *error = errno_text("cannot create", tmp_path);
    return false;
  }
  bool ok = write_all(fd, blob->data(), blob->size());
  if (!ok) *error = errno_text("cannot write", tmp_path);
  if (ok && options_.fsync && ::fsync(fd) != 0) {
    ok = false;
    *error = errno_text("cannot fsync", tmp_path);
  }
  if (::close(fd) != 0 && ok) {
    ok = false;
    *error = errno_text("cannot close", tmp_path);
  }
  if (ok && ::rename(tmp_path.c_str(), final_path.c_str()) != 0) {
    ok = false;
    *error = errno_text("cannot rename into", final_path);
  }
  if (!ok) ::unlink(tmp_path.c_str());
  return ok;
}

BufferPtr DiskStore::encode(const BufferPtr& blob, std::string* error) const {
  if (options_.codec == kCodecRaw && options_.codec_params == 0 && blob->size() > 8 && blob->data()[8] == kCodecRaw)
    return blob;
  BlobHeader h;
  Status st = blob_parse(blob->data(), blob->size(), !blob->verified(), &h);
  if (!st.ok) {
    *error = "not a valid blob: " + st.message;
    return nullptr;
  }
  if (h.codec == options_.codec && h.codec_params == options_.codec_params) return blob;
  try {
    return blob_transcode(h, blob->data(), options_.codec, options_.codec_params, 1, nullptr);
  } catch (const Error& e) {
    *error = std::string("cannot encode for disk: ") + e.what();
    return nullptr;
  }
}

bool DiskStore::write_blob(const Key128& key, const BufferPtr& queued) {
  std::string error;
  const BufferPtr blob = encode(queued, &error);  // outside the lock: may take milliseconds
  std::vector<Key128> victims;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = pending_.find(key);
    if (it == pending_.end() || it->second != queued) return false;  // removed or cleared meanwhile
    ++stats_.puts;
    if (!blob) {
      pending_.erase(key);
      record_error(error);
      return false;
    }
    if (!index_.contains(key)) {
      if (!index_.make_room(blob->size(), &victims)) {
        ++stats_.rejected;
        pending_.erase(key);
        return false;
      }
      stats_.evictions += victims.size();
      index_.insert(key, blob->size());
    }
  }
  unlink_keys(victims);
  bool ok = write_file(key, blob, &error);
  std::lock_guard<std::mutex> lock(mutex_);
  pending_.erase(key);
  if (!ok) {
    index_.erase(key);
    record_error(error);
  } else if (!index_.contains(key)) {  // removed or evicted while being written
    ::unlink(path_of(key).c_str());
  } else {
    ++stats_.writes;
  }
  return ok;
}

bool DiskStore::put(const Key128& key, const BufferPtr& blob) {
  KDN_CHECK(blob != nullptr, "DiskStore.put: blob is null");
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (pending_.count(key) || index_.contains(key)) return true;  // content-addressed: same key, same bytes
    pending_[key] = blob;
  }
  return write_blob(key, blob);
}

bool DiskStore::put_async(const Key128& key, const BufferPtr& blob) {
  KDN_CHECK(blob != nullptr, "DiskStore.put_async: blob is null");
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (pending_.count(key) || index_.contains(key)) return true;
    if (queued_bytes_ + blob->size() > options_.queue_bytes) {
      ++stats_.dropped;
      return false;
    }
    pending_[key] = blob;
    queue_.emplace_back(key, blob);
    queued_bytes_ += blob->size();
  }
  queue_cv_.notify_one();
  return true;
}

void DiskStore::writer_loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    queue_cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping and drained
    auto [key, blob] = std::move(queue_.front());
    queue_.pop_front();
    queued_bytes_ -= blob->size();
    writing_ = true;
    lock.unlock();
    write_blob(key, blob);
    lock.lock();
    writing_ = false;
    if (queue_.empty()) idle_cv_.notify_all();
  }
}

void DiskStore::flush() {
  std::unique_lock<std::mutex> lock(mutex_);
  idle_cv_.wait(lock, [this] { return queue_.empty() && !writing_; });
}

BufferPtr DiskStore::get(const Key128& key) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = pending_.find(key);
    if (it != pending_.end()) {
      ++stats_.hits;
      return it->second;
    }
  }
  std::string path = path_of(key), error;
  bool missing = false, corrupt = false;
  BufferPtr blob = read_file(path, &missing, &error);
  if (blob) {
    BlobHeader h;
    Status st = blob_parse(blob->data(), blob->size(), /*verify_checksum=*/true, &h);
    if (st.ok && h.key == key) {
      blob->mark_verified();
    } else {
      error = "corrupt blob file " + path + " (deleted): " + (st.ok ? "key differs from its name" : st.message);
      blob.reset();
      corrupt = true;
      ::unlink(path.c_str());
    }
  }
  std::vector<Key128> victims;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (blob) {
      if (index_.contains(key)) index_.touch(key);
      else adopt_locked(key, blob->size(), &victims);
      ++stats_.hits;
    } else {
      if (!pending_.count(key)) index_.erase(key);  // gone (another process evicted it) or corrupt
      ++stats_.misses;
      if (!missing) {
        if (corrupt) ++stats_.corrupt;
        record_error(error);
      }
    }
  }
  unlink_keys(victims);
  return blob;
}

std::vector<BufferPtr> DiskStore::get_many(const std::vector<Key128>& keys) {
  std::vector<BufferPtr> out(keys.size());
  readers_.run(static_cast<int64_t>(keys.size()), [&](int64_t i) { out[i] = get(keys[i]); });
  return out;
}

bool DiskStore::contains(const Key128& key) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (pending_.count(key) || index_.contains(key)) return true;
  }
  struct stat st;
  if (::stat(path_of(key).c_str(), &st) != 0 || st.st_size <= 0) return false;
  std::vector<Key128> victims;  // written by another process since start-up: adopt it
  bool adopted;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    adopted = adopt_locked(key, static_cast<uint64_t>(st.st_size), &victims);
  }
  unlink_keys(victims);
  return adopted;
}

int64_t DiskStore::count_prefix(const std::vector<Key128>& keys) {
  int64_t n = 0;
  while (n < static_cast<int64_t>(keys.size()) && contains(keys[n])) ++n;
  return n;
}

bool DiskStore::remove(const Key128& key) {
  bool known;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    known = index_.erase(key);
    known = pending_.erase(key) != 0 || known;  // a queued write of it is skipped
  }
  bool unlinked = ::unlink(path_of(key).c_str()) == 0;
  return known || unlinked;
}

bool DiskStore::pin(const Key128& key, double ttl_seconds) {
  if (!contains(key)) return false;
  std::lock_guard<std::mutex> lock(mutex_);
  return index_.pin(key, ttl_seconds);
}

bool DiskStore::unpin(const Key128& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  return index_.unpin(key);
}

void DiskStore::clear() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.clear();
    queued_bytes_ = 0;
    pending_.clear();
  }
  flush();  // a write in progress finishes, then finds its key gone and deletes its file
  std::lock_guard<std::mutex> lock(mutex_);
  index_.clear();
  std::error_code ec;
  for (fs::directory_iterator shard(options_.dir, ec), end; !ec && shard != end; shard.increment(ec)) {
    if (shard->path().filename().string().size() != 2) continue;
    std::error_code ec2;
    for (fs::directory_iterator f(shard->path(), ec2); !ec2 && f != end; f.increment(ec2))
      if (f->path().extension() == kSuffix) ::unlink(f->path().c_str());
  }
}

DiskStats DiskStore::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  DiskStats s = stats_;
  index_.fill_sizes(&s);
  s.queued_entries = queue_.size();
  s.queued_bytes = queued_bytes_;
  return s;
}

}  // namespace kdn
