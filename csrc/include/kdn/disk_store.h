// Local-disk blob store: one file per blob, atomic writes, checksum verified on every read,
// index rebuilt at start-up, bounded asynchronous write-behind, reads on a small thread pool.
//
// Contract:
// * Files are `<dir>/<k0k1>/<32 hex key>.kdnb`. A write goes to `<dir>/tmp/<key>.<pid>.<n>.tmp`,
//   is fsync'ed (unless disabled) and renamed into place, so a reader (in this or another
//   process) sees the whole blob or nothing; a process killed mid-write leaves only a temporary
//   file, removed by the next store that opens the directory once its writer is dead.
// * Every read checks the header and the file size first (nothing is allocated for a file whose
//   size disagrees with its header), then the XXH64 checksum and key; with a `mac_key` also the
//   keyed BLAKE3 tag that follows the blob in the file. A damaged file (its header, size,
//   checksum or key wrong) is deleted and reported as a miss (counted as `corrupt`); a well-formed
//   blob file of another key (tagged when this store has no key, untagged or failing the tag when
//   it has one: a keyed tenant's, or a forgery) is a miss counted as `foreign` and never deleted,
//   nor counted as held until this store writes that key itself (the rename replaces it).
// * `read_only` (an audit, a reader that never writes the disk): nothing is ever written or
//   unlinked implicitly (no damaged file deleted, no temporary swept); only remove() and clear().
// * Trust: files are created 0600 and directories 0700 (0660 / 2770 with `group_shared`); a
//   symlink inside the tier (a shard directory or a blob file) is never followed: reads, writes,
//   eviction and clear() skip it. The index never claims a file that is gone: a lookup of an
//   indexed key re-checks that its file exists, so another process's eviction is seen at once.
// * The index (keys, sizes, eviction order by file mtime) is rebuilt at start-up, newest first;
//   keys written by another process after that are adopted on first lookup. Adopting never
//   evicts: files beyond this store's capacity stay on disk, readable and unindexed, so opening a
//   shared directory with a smaller capacity deletes nothing; sparse files (allocated far below
//   their size) are not blobs and are skipped. Only this process's writes make room, evicting
//   from what it indexed (processes sharing a directory should use the same capacity).
// * No method throws for I/O: failures (disk full, permission denied, a vanished directory)
//   make the write "not stored", are counted in `errors` and remembered in `last_error`;
//   missing directories are re-created on the next write.
// * put_async never blocks on I/O: it enqueues a shared reference to the blob (visible to get
//   at once) or, when `queue_bytes` are already waiting, drops it (counted as `dropped`).
// * Thread-safe; one mutex guards the index and queue, never held during file I/O.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "kdn/blob.h"
#include "kdn/memory_store.h"
#include "kdn/thread_pool.h"
#include "kdn/tier_index.h"

namespace kdn {

struct DiskStoreOptions {
  std::string dir;
  uint64_t capacity_bytes = 0;
  std::string policy = "lru";
  uint64_t queue_bytes = 512ull << 20;
  int read_threads = 4;
  bool fsync = true;
  uint8_t codec = kCodecRaw;  // blobs are written coded with (codec, codec_params), in the writer
  uint32_t codec_params = 0;  // thread for put_async (kdn/codec.h)
  std::string mac_key;        // 32 bytes: files end with a keyed BLAKE3 tag of the blob; empty: off
  bool group_shared = false;  // files 0660 and directories 2770 instead of 0600 / 0700
  bool read_only = false;     // never writes nor unlinks a file implicitly (see the contract)
};

struct DiskStats : TierStats {
  uint64_t writes = 0, errors = 0, corrupt = 0, dropped = 0, adopted = 0;
  uint64_t vanished = 0;  // indexed files found gone (another process evicted them)
  uint64_t foreign = 0;   // reads of well-formed blob files of another key (kept, misses)
  uint64_t unindexed = 0; // files found but not indexed: beyond this store's capacity, or sparse
  uint64_t queued_entries = 0, queued_bytes = 0;
  uint64_t read_bytes = 0;  // bytes read from blob files (of a blob read in part: what was read)
  std::string last_error;
};

class DiskStore {
 public:
  explicit DiskStore(DiskStoreOptions options);
  ~DiskStore();  // drains the write queue
  DiskStore(const DiskStore&) = delete;
  DiskStore& operator=(const DiskStore&) = delete;

  // Both file the blob under coded_key(its header with `key`, the store's codec): a lossy disk
  // codec files a chunk under its lossy key (kdn/codec.h), whoever hands it over (spills too).
  bool put(const Key128& key, const BufferPtr& blob);        // synchronous; false if not stored
  bool put_async(const Key128& key, const BufferPtr& blob);  // false if dropped or refused
  void flush();                                              // waits until the queue is written
  bool flush_for(double seconds);                            // the same, at most `seconds`; true if drained
  BufferPtr get(const Key128& key);                          // verified blob, nullptr on miss
  std::vector<BufferPtr> get_many(const std::vector<Key128>& keys);  // in parallel
  // The same, reading of key i only sections[i] (inclusive ranges of its sections: Buffer::partial,
  // those verified) where it has any and the blob can be read in part (blob_file::read_file); whole
  // otherwise (an empty list, a keyed store, a blob still queued for writing).
  std::vector<BufferPtr> get_many(const std::vector<Key128>& keys,
                                  const std::vector<std::vector<std::pair<uint64_t, uint64_t>>>& sections);
  bool contains(const Key128& key);
  int64_t count_prefix(const std::vector<Key128>& keys);
  bool remove(const Key128& key);
  bool pin(const Key128& key, double ttl_seconds);  // pins live in this process only
  bool unpin(const Key128& key);
  bool set_priority(const Key128& key, int priority);  // TierIndex::set_priority; in this process only, as pins
  void set_quota(uint64_t owner, uint64_t bytes);  // TierIndex::set_quota (0: none)
  void record_events(bool on);                      // TierIndex::record_events
  std::vector<TierIndex::Event> take_events();
  void clear();                                     // every blob file of the directory
  void inject_write_failures(int64_t n) { inject_failures_ = n; }  // tests: next n writes fail
  DiskStats stats() const;
  std::string path_of(const Key128& key) const;
  const DiskStoreOptions& options() const { return options_; }

 private:
  BufferPtr get_sections(const Key128& key, const std::vector<std::pair<uint64_t, uint64_t>>* sections);
  void rebuild_index();
  void remove_stale_temporaries();
  BufferPtr encode(const BufferPtr& blob, std::string* error) const;  // with the store's codec
  Key128 file_key(const Key128& key, const BufferPtr& blob) const;     // see put
  bool write_blob(const Key128& key, const BufferPtr& blob);  // key already in pending_
  Status write_file(const Key128& key, const BufferPtr& blob);
  bool adopt_locked(const Key128& key, uint64_t bytes, uint64_t owner = 0);  // indexed if it fits; never evicts
  void unlink_keys(const std::vector<Key128>& keys);
  bool file_present(const Key128& key) const;
  uint64_t file_bytes(const Buffer& blob) const;     // what the blob's file takes (tag included)
  Status make_private_dir(const std::string& path) const;  // 0700 (2770 group-shared); never a symlink
  // A folder of the tier this store may read and write through: a real directory (never a symlink)
  // this user owns that no one else can write (group-shared: the group may; no one else).
  bool trusted_dir(const std::string& path) const;
  bool held_locked(const Key128& key);               // pending, or indexed with its file present
  void record_error(const std::string& error);
  void writer_loop();

  const DiskStoreOptions options_;
  mutable std::mutex mutex_;
  std::condition_variable queue_cv_, idle_cv_;
  TierIndex index_;
  std::unordered_map<Key128, BufferPtr, Key128Hash> pending_;  // queued or being written
  std::unordered_set<Key128, Key128Hash> foreign_;  // keys whose file is another key's blob (not held)
  std::deque<std::pair<Key128, BufferPtr>> queue_;
  uint64_t queued_bytes_ = 0;
  bool writing_ = false, stop_ = false;
  DiskStats stats_;
  std::atomic<int64_t> inject_failures_{0};
  std::atomic<uint64_t> tmp_counter_{0};
  ThreadPool readers_;
  std::thread writer_;
};

}  // namespace kdn
