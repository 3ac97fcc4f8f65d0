// Local-disk blob store (contract in kdn/disk_store.h).
#include "kdn/disk_store.h"

#include "blob_file.h"

#include "kdn/codec.h"
#include "kdn/hash.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <system_error>

namespace fs = std::filesystem;

namespace kdn {
using namespace blob_file;  // NOLINT: this file is the blob files' one user

DiskStore::DiskStore(DiskStoreOptions options)
    : options_(std::move(options)),
      index_(options_.capacity_bytes, options_.policy),
      readers_(std::max(1, options_.read_threads)) {
  KDN_CHECK_INPUT(!options_.dir.empty(), "DiskStore: the directory is empty");
  KDN_CHECK_INPUT(options_.capacity_bytes > 0, "DiskStore: capacity_bytes must be positive");
  KDN_CHECK_INPUT(options_.mac_key.empty() || options_.mac_key.size() == kMacBytes,
                  "DiskStore: mac_key must be 32 bytes (or empty)");
  std::error_code ec;
  if (!fs::exists(options_.dir, ec)) {
    fs::create_directories(fs::path(options_.dir).parent_path(), ec);
    Status st = make_private_dir(options_.dir);
    if (!st.ok) throw InputError("DiskStore: " + st.message, __FILE__, __LINE__);
  }
  if (!trusted_dir(options_.dir))
    throw InputError("DiskStore: " + options_.dir + " is not a directory of this user's that no one else can write " +
                     "(another local user could plant KV there)", __FILE__, __LINE__);
  Status st = make_private_dir(options_.dir + "/tmp");
  if (!st.ok) throw InputError("DiskStore: " + st.message, __FILE__, __LINE__);
  if (!options_.read_only) remove_stale_temporaries();
  rebuild_index();
  try {
    writer_ = std::thread([this] { writer_loop(); });
  } catch (const std::system_error& e) {
    throw Error(std::string("DiskStore: cannot start its writer thread (") + e.what() + ")", __FILE__, __LINE__);
  }
}

DiskStore::~DiskStore() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  queue_cv_.notify_all();
  writer_.join();
}

bool DiskStore::trusted_dir(const std::string& path) const {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || (st.st_mode & S_IWOTH)) return false;
  return options_.group_shared || (st.st_uid == ::geteuid() && !(st.st_mode & S_IWGRP));
}

Status DiskStore::make_private_dir(const std::string& path) const {
  const mode_t mode = options_.group_shared ? 02770 : 0700;
  if (::mkdir(path.c_str(), mode) == 0) {
    ::chmod(path.c_str(), mode);  // the umask must not widen or narrow what was asked
    return Status::Ok();
  }
  struct stat st;
  if (errno == EEXIST && ::lstat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode) && trusted_dir(path)) return Status::Ok();
    if (S_ISDIR(st.st_mode))
      return Status::Fail("cannot use " + path + ": it belongs to uid " + std::to_string(st.st_uid) +
                          " or others can write it (another local user could plant KV there)");
    return Status::Fail("cannot create " + path + (S_ISLNK(st.st_mode)
                                                       ? ": it is a symlink (not followed inside a disk tier)"
                                                       : ": it exists and is not a directory"));
  }
  return Status::Fail(errno_text("cannot create", path));
}

uint64_t DiskStore::file_bytes(const Buffer& blob) const {
  return blob.size() + (options_.mac_key.empty() ? 0 : kMacBytes);
}

bool DiskStore::file_present(const Key128& key) const {
  const std::string path = path_of(key);
  struct stat st;
  return trusted_dir(path.substr(0, path.rfind('/'))) && ::lstat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
         static_cast<uint64_t>(st.st_size) >= kBlobHeaderBytes + kBlobTrailerBytes;
}

bool DiskStore::held_locked(const Key128& key) {
  if (pending_.count(key)) return true;
  if (foreign_.count(key) || !index_.contains(key)) return false;
  if (file_present(key)) return true;
  index_.erase(key);  // another process evicted or removed it: the index must not claim it
  ++stats_.vanished;
  return false;
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
    if (shard->path().filename().string().size() != 2 || !trusted_dir(shard->path().string())) continue;
    std::error_code ec2;
    for (fs::directory_iterator f(shard->path(), ec2); !ec2 && f != end; f.increment(ec2)) {
      std::string name = f->path().filename().string();
      Key128 key;
      if (name.size() != 32 + std::strlen(kSuffix) || name.substr(32) != kSuffix || !key_from_hex(name.substr(0, 32), &key))
        continue;
      struct stat st;
      if (::lstat(f->path().c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;  // symlinks are not blobs
      if (!options_.group_shared && st.st_uid != ::geteuid()) continue;  // another user's: not this store's
      const uint64_t bytes = static_cast<uint64_t>(st.st_size);
      const bool sparse = bytes > (1u << 20) && static_cast<uint64_t>(st.st_blocks) * 512 < bytes / 2;
      if (bytes < kBlobHeaderBytes + kBlobTrailerBytes || bytes > kMaxBlobFileBytes || sparse) {
        ++stats_.unindexed;  // not a blob this store could have written: left alone
        continue;
      }
      std::error_code ec3;
      auto mtime = f->last_write_time(ec3);
      if (!ec3) found.push_back({mtime, key, bytes});
    }
  }
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) { return a.mtime > b.mtime; });
  for (const auto& f : found) adopt_locked(f.key, f.bytes);  // newest first, while they fit: nothing evicted
}

bool DiskStore::adopt_locked(const Key128& key, uint64_t bytes, uint64_t owner) {
  if (index_.contains(key)) return true;
  if (index_.used_bytes() + bytes > index_.capacity()) {
    ++stats_.unindexed;
    return false;
  }
  std::vector<Key128> none;
  if (!index_.make_room(bytes, &none) || !none.empty()) return false;  // cannot happen: it fits
  index_.insert(key, bytes, owner);
  ++stats_.adopted;
  return true;
}

void DiskStore::unlink_keys(const std::vector<Key128>& keys) {
  for (const auto& key : keys) {
    const std::string path = path_of(key);
    if (trusted_dir(path.substr(0, path.rfind('/')))) ::unlink(path.c_str());
  }
}

void DiskStore::record_error(const std::string& error) {
  ++stats_.errors;
  stats_.last_error = error;
}

Status DiskStore::write_file(const Key128& key, const BufferPtr& blob) {
  if (inject_failures_.load() > 0 && inject_failures_.fetch_sub(1) > 0)
    return Status::Fail("injected write failure (No space left on device)");
  std::string hex = key_hex(key);
  std::string final_path = path_of(key);
  std::string tmp_dir = options_.dir + "/tmp";
  std::string tmp_path = tmp_dir + "/" + hex + "." + std::to_string(::getpid()) + "." +
                         std::to_string(tmp_counter_.fetch_add(1)) + ".tmp";
  for (const std::string& dir : {options_.dir, tmp_dir, options_.dir + "/" + hex.substr(0, 2)}) {
    Status st = make_private_dir(dir);
    if (!st.ok) return st;
  }
  const mode_t mode = options_.group_shared ? 0660 : 0600;
  int fd = ::open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, mode);
  if (fd < 0) return Status::Fail(errno_text("cannot create", tmp_path));
  if (options_.group_shared) ::fchmod(fd, mode);
  bool ok = write_all(fd, blob->data(), blob->size());
  if (ok && !options_.mac_key.empty()) {
    uint8_t tag[kMacBytes];
    mac_of(options_.mac_key, blob->data(), blob->size(), tag);
    ok = write_all(fd, tag, kMacBytes);
  }
  Status st = ok ? Status::Ok() : Status::Fail(errno_text("cannot write", tmp_path));
  if (st.ok && options_.fsync && ::fsync(fd) != 0) st = Status::Fail(errno_text("cannot fsync", tmp_path));
  if (::close(fd) != 0 && st.ok) st = Status::Fail(errno_text("cannot close", tmp_path));
  if (st.ok && ::rename(tmp_path.c_str(), final_path.c_str()) != 0)
    st = Status::Fail(errno_text("cannot rename into", final_path));
  if (!st.ok) ::unlink(tmp_path.c_str());
  return st;
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
      const uint64_t owner = owner_of_blob(blob->data(), blob->size());
      if (!index_.make_room(file_bytes(*blob), &victims, owner)) {
        ++stats_.rejected;
        pending_.erase(key);
        return false;
      }
      stats_.evictions += victims.size();
      index_.insert(key, file_bytes(*blob), owner);
    }
  }
  unlink_keys(victims);
  const Status written = write_file(key, blob);
  std::lock_guard<std::mutex> lock(mutex_);
  pending_.erase(key);
  if (!written.ok) {
    index_.erase(key);
    record_error(written.message);
  } else if (!index_.contains(key)) {  // removed or evicted while being written
    ::unlink(path_of(key).c_str());
  } else {
    foreign_.erase(key);  // the rename replaced another key's file: this store's own now
    ++stats_.writes;
  }
  return written.ok;
}

Key128 DiskStore::file_key(const Key128& key, const BufferPtr& blob) const {
  BlobHeader h;
  if (!blob_parse(blob->data(), blob->size(), false, &h).ok) return key;  // write_blob reports it
  h.key = key;
  return coded_key(h, options_.codec, options_.codec_params);
}

bool DiskStore::put(const Key128& given_key, const BufferPtr& blob) {
  KDN_CHECK(blob != nullptr, "DiskStore.put: blob is null");
  if (options_.read_only || blob->partial()) return false;  // a blob read in part is never filed
  const Key128 key = file_key(given_key, blob);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (held_locked(key)) return true;  // content-addressed: same key, same bytes
    pending_[key] = blob;
  }
  return write_blob(key, blob);
}

bool DiskStore::put_async(const Key128& given_key, const BufferPtr& blob) {
  KDN_CHECK(blob != nullptr, "DiskStore.put_async: blob is null");
  if (options_.read_only || blob->partial()) return false;  // a blob read in part is never filed
  const Key128 key = file_key(given_key, blob);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (held_locked(key)) return true;
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
#ifdef __linux__
  pthread_setname_np(pthread_self(), "kdn-disk-write");  // top -H, /proc/<pid>/task/<tid>/comm
#endif
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

bool DiskStore::flush_for(double seconds) {
  std::unique_lock<std::mutex> lock(mutex_);
  return idle_cv_.wait_for(lock, std::chrono::duration<double>(seconds > 0 ? seconds : 0),
                           [this] { return queue_.empty() && !writing_; });
}

BufferPtr DiskStore::get(const Key128& key) { return get_sections(key, nullptr); }

BufferPtr DiskStore::get_sections(const Key128& key, const blob_file::SectionSpans* sections) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = pending_.find(key);
    if (it != pending_.end()) {
      ++stats_.hits;
      return it->second;
    }
  }
  std::string path = path_of(key), error;
  uint64_t read_bytes = 0;
  bool missing = !trusted_dir(path.substr(0, path.rfind('/'))), corrupt = false, foreign = false;  // a planted shard: a miss
  BufferPtr blob = missing ? nullptr : read_file(path, options_.mac_key, options_.group_shared, &missing, &corrupt, &foreign, &error,
                                                  sections, &read_bytes);
  if (blob) {
    BlobHeader h;
    // a partial read verified its sections and its header (section 0); a whole one is checked whole
    Status st = blob_parse(blob->data(), blob->size(), /*verify_checksum=*/!blob->partial(), &h);
    if (st.ok && h.key == key) {
      blob->mark_verified();
    } else {
      error = "corrupt blob file " + path + ": " + (st.ok ? "key differs from its name" : st.message);
      blob.reset();
      corrupt = true;
    }
  }
  if (corrupt && !options_.read_only && trusted_dir(path.substr(0, path.rfind('/')))) {
    ::unlink(path.c_str());
    error += " (deleted)";
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.read_bytes += read_bytes;
    if (blob) {
      if (index_.contains(key)) index_.touch(key);
      else adopt_locked(key, file_bytes(*blob), owner_of_blob(blob->data(), blob->size()));
      ++stats_.hits;
    } else {
      if (!pending_.count(key)) index_.erase(key);  // gone (another process evicted it), corrupt or foreign
      ++stats_.misses;
      if (foreign) {  // not this store's to judge or delete: a miss until this store writes the key
        if (foreign_.size() >= (1u << 16)) foreign_.clear();
        foreign_.insert(key);
        ++stats_.foreign;
        stats_.last_error = error;
      } else if (corrupt) {  // counted once, as corrupt; `errors` counts failed I/O
        ++stats_.corrupt;
        stats_.last_error = error;
      } else if (!missing) {
        record_error(error);
      }
    }
  }
  return blob;
}

std::vector<BufferPtr> DiskStore::get_many(const std::vector<Key128>& keys) {
  std::vector<BufferPtr> out(keys.size());
  readers_.run(static_cast<int64_t>(keys.size()), [&](int64_t i) { out[i] = get(keys[i]); });
  return out;
}

std::vector<BufferPtr> DiskStore::get_many(const std::vector<Key128>& keys,
                                           const std::vector<blob_file::SectionSpans>& sections) {
  KDN_CHECK_INPUT(sections.size() == keys.size(), "DiskStore.get_many: one list of sections per key");
  std::vector<BufferPtr> out(keys.size());
  readers_.run(static_cast<int64_t>(keys.size()), [&](int64_t i) {
    out[i] = get_sections(keys[i], sections[i].empty() ? nullptr : &sections[i]);
  });
  return out;
}

bool DiskStore::contains(const Key128& key) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (held_locked(key)) return true;
    if (foreign_.count(key)) return false;
  }
  struct stat st;
  if (!file_present(key) || ::lstat(path_of(key).c_str(), &st) != 0) return false;
  std::lock_guard<std::mutex> lock(mutex_);  // written by another process since start-up: adopted if it fits
  adopt_locked(key, static_cast<uint64_t>(st.st_size));
  return true;
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
    foreign_.erase(key);
  }
  const std::string path = path_of(key);  // never in a shard folder another user owns or can write
  bool unlinked = trusted_dir(path.substr(0, path.rfind('/'))) && ::unlink(path.c_str()) == 0;
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

bool DiskStore::set_priority(const Key128& key, int priority) {
  if (!contains(key)) return false;
  std::lock_guard<std::mutex> lock(mutex_);
  return index_.set_priority(key, priority);
}

void DiskStore::set_quota(uint64_t owner, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  index_.set_quota(owner, bytes);
}

void DiskStore::record_events(bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  index_.record_events(on);
}

std::vector<TierIndex::Event> DiskStore::take_events() {
  std::lock_guard<std::mutex> lock(mutex_);
  return index_.take_events();
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
  foreign_.clear();
  std::error_code ec;
  for (fs::directory_iterator shard(options_.dir, ec), end; !ec && shard != end; shard.increment(ec)) {
    if (shard->path().filename().string().size() != 2 || !trusted_dir(shard->path().string())) continue;  // never followed
    std::error_code ec2;
    for (fs::directory_iterator f(shard->path(), ec2); !ec2 && f != end; f.increment(ec2))
      if (f->path().extension() == kSuffix) ::unlink(f->path().c_str());  // unlink never follows a link
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
