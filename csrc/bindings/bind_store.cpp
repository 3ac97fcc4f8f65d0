// Python bindings of the blob Buffer, blob parsing and the memory and disk stores.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>

#include "kdn/codec.h"
#include "kdn/disk_store.h"
#include "kdn/memory_store.h"
#include "kdn/resp.h"
#include "tensor.h"

namespace py = pybind11;

namespace kdn {

Key128 key_arg(py::handle obj, const char* what);

py::list events_list(const std::vector<TierIndex::Event>& events) {
  py::list out;
  for (const auto& e : events)
    out.append(py::make_tuple(e.stored, py::bytes(reinterpret_cast<const char*>(e.key.data()), e.key.size())));
  return out;
}

BufferPtr buffer_from_object(py::handle obj) {
  if (py::isinstance<Buffer>(obj)) return obj.cast<BufferPtr>();
  ByteSpan span = bytes_from_object(obj, "blob");
  auto buf = std::make_shared<Buffer>(span.size);
  py::gil_scoped_release release;
  std::memcpy(buf->data(), span.data, span.size);
  return buf;
}

py::dict header_to_dict(const BlobHeader& h) {
  py::dict d;
  d["version"] = h.version;
  d["kind"] = h.kind == kBlobKindKV            ? "kv"
              : h.kind == kBlobKindPointer     ? "pointer"
              : h.kind == kBlobKindCalibration ? "calibration"
                                               : "sidecar";
  d["codec"] = h.codec;
  d["codec_params"] = h.codec_params;
  d["dtype"] = dtype_name(h.dtype);
  d["layers"] = h.layers;
  d["kv_heads"] = h.kv_heads;
  d["head_dim"] = h.head_dim;
  d["tokens"] = h.tokens;
  d["position"] = h.position;
  d["fingerprint"] = py::bytes(reinterpret_cast<const char*>(h.fingerprint.data()), 16);
  d["key"] = py::bytes(reinterpret_cast<const char*>(h.key.data()), 16);
  d["payload_bytes"] = h.payload_bytes;
  return d;
}

std::vector<Key128> keys_arg(const py::list& keys) {
  std::vector<Key128> out;
  out.reserve(keys.size());
  for (auto k : keys) out.push_back(key_arg(k, "key"));
  return out;
}

py::dict tier_stats_dict(const TierStats& st) {
  py::dict d;
  d["hits"] = st.hits;
  d["misses"] = st.misses;
  d["puts"] = st.puts;
  d["evictions"] = st.evictions;
  d["rejected"] = st.rejected;
  d["entries"] = st.entries;
  d["used_bytes"] = st.used_bytes;
  d["capacity_bytes"] = st.capacity_bytes;
  d["pinned_entries"] = st.pinned_entries;
  d["pinned_bytes"] = st.pinned_bytes;
  d["tenants"] = st.tenants;  // owners holding entries: each gets a fair share of the tier
  return d;
}

void bind_store(py::module_& m) {
  py::class_<Buffer, BufferPtr>(m, "Buffer", py::buffer_protocol(),
                                "Immutable reference-counted bytes (a blob); supports memoryview().")
      .def(py::init([](py::handle data) { return buffer_from_object(data); }), py::arg("data"))
      .def_static(
          "empty",
          [](size_t size) {
            KDN_CHECK_INPUT(size <= (size_t(1) << 40), "Buffer.empty: size " + std::to_string(size) + " is too large");
            return std::make_shared<Buffer>(size, /*writable=*/true);
          },
          py::arg("size"),
          "A writable Buffer of size bytes (uninitialised) for a producer to fill in place; freeze() it when filled.")
      .def("freeze", &Buffer::freeze, "Read-only from now on (a filled Buffer that becomes a blob).")
      .def("__len__", &Buffer::size)
      .def("tobytes", [](const Buffer& b) { return py::bytes(reinterpret_cast<const char*>(b.data()), b.size()); })
      .def_property_readonly("writable", &Buffer::writable)
      .def_property_readonly("verified", &Buffer::verified, "True once kdn sealed or checked this blob's checksum.")
      .def_property_readonly("partial", &Buffer::partial,
                             "True for a blob read in part (DiskStore.get_many's sections): never stored or kept.")
      .def_buffer([](Buffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<ssize_t>(b.size())}, {1}, /*readonly=*/!b.writable());
      });

  py::register_exception<RespError>(m, "RespError", PyExc_RuntimeError);
  py::register_exception<RespIOError>(m, "RespIOError", PyExc_ConnectionError);
  py::class_<RespConnection>(m, "RespConnection",
                             "One Redis connection whose GET and GETRANGE replies land straight in pooled Buffers (kdn/resp.h).")
      .def(py::init([](const std::string& host, int port, double timeout, const std::string& user,
                       const std::string& password, int db) {
             py::gil_scoped_release release;
             return std::make_unique<RespConnection>(host, port, std::max(1, static_cast<int>(timeout * 1000)), user,
                                                     password, db);
           }),
           py::arg("host"), py::arg("port"), py::arg("timeout") = 1.0, py::arg("user") = "",
           py::arg("password") = "", py::arg("db") = 0,
           "host:port (a unix socket path when port < 0); AUTH and SELECT when given.")
      .def(
          "get_many",
          [](RespConnection& self, const std::vector<std::string>& names, int64_t max_bytes) {
            KDN_CHECK_INPUT(max_bytes >= 0, "RespConnection.get_many: max_bytes must be >= 0");
            std::vector<BufferPtr> values;
            {
              py::gil_scoped_release release;
              values = self.get_many(names, max_bytes);
            }
            py::list out;
            for (auto& v : values) out.append(v ? py::cast(v) : py::none());
            return out;
          },
          py::arg("names"), py::arg("max_bytes") = 0,
          "GET of every name in one round trip: a Buffer per value, None for a missing key; with "
          "max_bytes > 0, at most max_bytes + 1 bytes of each (GETRANGE).")
      .def(
          "get_ranges",
          [](RespConnection& self, const std::vector<std::tuple<std::string, int64_t, int64_t>>& requests) {
            std::vector<RespConnection::Range> ranges;
            ranges.reserve(requests.size());
            for (const auto& [name, start, end] : requests) ranges.push_back({name, start, end});
            std::vector<BufferPtr> values;
            {
              py::gil_scoped_release release;
              values = self.get_ranges(ranges);
            }
            py::list out;
            for (auto& v : values) out.append(py::cast(v));
            return out;
          },
          py::arg("requests"),
          "GETRANGE of every (name, start, end) in one round trip (inclusive ends, negative from the "
          "value's end): a Buffer per range, empty for a missing key.")
      .def(
          "set_many",
          [](RespConnection& self, const std::vector<std::pair<std::string, py::buffer>>& items, int64_t ttl_ms) {
            std::vector<py::buffer_info> held;  // keeps each value's memory exported while the GIL is released
            held.reserve(items.size());
            std::vector<RespConnection::Value> values;
            values.reserve(items.size());
            for (const auto& [name, value] : items) {
              held.push_back(value.request());
              const py::buffer_info& info = held.back();
              KDN_CHECK_INPUT(info.ndim <= 1 && (info.ndim == 0 || info.strides[0] == info.itemsize),
                              "RespConnection.set_many: the value of " + name + " is not contiguous");
              values.push_back({name, static_cast<const uint8_t*>(info.ptr), size_t(info.size * info.itemsize)});
            }
            py::gil_scoped_release release;
            self.set_many(values, ttl_ms);
          },
          py::arg("items"), py::arg("ttl_ms") = 0,
          "SET of every (name, value) in one round trip, PX ttl_ms when > 0; values (bytes-like, "
          "contiguous) are sent from their own memory.")
      .def(
          "commands",
          [](RespConnection& self, const std::vector<std::vector<std::string>>& cmds) {
            std::vector<RespConnection::Reply> replies;
            {
              py::gil_scoped_release release;
              replies = self.commands(cmds);
            }
            py::list out;
            for (const auto& r : replies) {
              if (r.kind == RespConnection::Reply::kInteger) out.append(py::int_(r.integer));
              else if (r.kind == RespConnection::Reply::kStatus) out.append(py::str(r.text));
              else if (r.kind == RespConnection::Reply::kBulk) out.append(py::bytes(r.text));
              else out.append(py::none());
            }
            return out;
          },
          py::arg("commands"),
          "Small commands (lists of arguments) in one round trip under the call's deadline: an int, a "
          "status str, bytes (at most 4 KiB) or None per command.")
      .def_property_readonly("open", &RespConnection::open)
      .def_property_readonly("in_step", &RespConnection::in_step,
                             "Open with nothing unread (no reply nobody asked for): safe to reuse.");
  m.def(
      "sidecar_pack",
      [](py::handle fingerprint, py::handle key, py::handle data) {
        ByteSpan span = bytes_from_object(data, "sidecar");
        return pack_bytes_blob(kBlobKindSidecar, key_arg(fingerprint, "fingerprint"), key_arg(key, "key"), span.data,
                               span.size);
      },
      py::arg("fingerprint"), py::arg("key"), py::arg("data"),
      "A sealed sidecar blob (an edit's bytes kept beside the KV) filed under `key` for the model `fingerprint`.");
  m.def(
      "sidecar_read",
      [](py::handle blob, py::handle fingerprint, py::handle key) {
        ByteSpan span = bytes_from_object(blob, "blob");
        size_t offset = 0, bytes = 0;
        Status st = read_bytes_blob(span.data, span.size, kBlobKindSidecar, key_arg(fingerprint, "fingerprint"),
                                    key_arg(key, "key"), &offset, &bytes);
        if (!st.ok) throw BlobError("sidecar: " + st.message, __FILE__, __LINE__);
        return py::bytes(reinterpret_cast<const char*>(span.data + offset), bytes);
      },
      py::arg("blob"), py::arg("fingerprint"), py::arg("key"),
      "The bytes of a sidecar blob of this model and key (checksum verified); BlobError if unusable.");
  m.def("buffer_join", [](const py::list& parts) {
        std::vector<ByteSpan> spans;
        size_t total = 0;
        for (auto p : parts) {
          spans.push_back(bytes_from_object(p, "part"));
          total += spans.back().size;
        }
        auto buf = std::make_shared<Buffer>(total);
        py::gil_scoped_release release;
        size_t at = 0;
        for (const auto& s : spans) {
          std::memcpy(buf->data() + at, s.data, s.size);
          at += s.size;
        }
        return buf;
      }, py::arg("parts"), "One Buffer holding the bytes of `parts` in order (one copy).");
  m.def("host_array", [](size_t nbytes) { return std::make_shared<Buffer>(nbytes, /*writable=*/true); },
        py::arg("nbytes"),
        "A writable, uninitialised pooled host buffer (torch.frombuffer(...) gives a tensor on warm pages).");
  m.def("buffer_pool_stats", [] {
    BufferPoolStats st = buffer_pool_stats();
    py::dict d;
    d["idle_bytes"] = st.idle_bytes;
    d["idle_blocks"] = st.idle_blocks;
    d["limit_bytes"] = st.limit_bytes;
    d["reused"] = st.reused;
    d["allocated"] = st.allocated;
    d["locked_bytes"] = st.locked_bytes;
    d["locked_blocks"] = st.locked_blocks;
    d["lock_failures"] = st.lock_failures;
    d["huge_pages"] = st.huge_pages;
    d["lock_pages"] = st.lock_pages;
    return d;
  });
  m.def("buffer_pool_huge_pages", &buffer_pool_huge_pages, py::arg("on"),
        "Whether new pooled blocks of 2 MiB or more ask the kernel for transparent huge pages (default True).");
  m.def("buffer_pool_lock_pages", &buffer_pool_lock_pages, py::arg("on"),
        "Page-lock every pooled host block handed out from now on (a CUDA build with a device; a refusal turns it\n"
        "off, counted in buffer_pool_stats()['lock_failures']): hits then upload straight from the blobs.");
  m.def("buffer_pool_set_limit", &buffer_pool_set_limit, py::arg("bytes"));
  m.def("buffer_pool_trim", &buffer_pool_trim, "Return every idle pooled block to the system allocator.");

  m.def(
      "blob_parse",
      [](py::handle blob, bool verify_checksum) {
        ByteSpan span = bytes_from_object(blob, "blob");
        BlobHeader h;
        Status st;
        {
          py::gil_scoped_release release;
          st = blob_parse(span.data, span.size, verify_checksum, &h);
        }
        if (!st.ok) throw BlobError(st.message, __FILE__, __LINE__);
        if (verify_checksum && py::isinstance<Buffer>(blob)) blob.cast<Buffer&>().mark_verified();
        return header_to_dict(h);
      },
      py::arg("blob"), py::arg("verify_checksum") = true,
      "Validate a blob and return its header as a dict; raises BlobError. A kdn Buffer whose checksum\n"
      "was checked is marked verified, so retrieve does not hash it again.");

  m.def(
      "blob_sections",
      [](py::handle prefix) {
        ByteSpan span = bytes_from_object(prefix, "prefix");
        BlobHeader h;
        Status st = blob_parse_header(span.data, span.size, &h);
        if (!st.ok) throw BlobError(st.message, __FILE__, __LINE__);
        const uint64_t table = kBlobHeaderBytes + blob_table_bytes(h);
        KDN_CHECK_INPUT(span.size >= table, "blob_sections: the prefix must hold the header and the plane table (" +
                                                std::to_string(table) + " bytes)");
        py::dict d = header_to_dict(h);
        py::list ranges;
        if (h.version >= 2)
          for (const auto& r : blob_section_ranges(h, span.data + kBlobHeaderBytes, span.size - kBlobHeaderBytes))
            ranges.append(py::make_tuple(r.first, r.second));
        d["sections"] = ranges;
        d["trailer"] = py::make_tuple(kBlobHeaderBytes + h.payload_bytes, blob_total_bytes(h));
        d["total_bytes"] = blob_total_bytes(h);
        return d;
      },
      py::arg("prefix"),
      "Header and byte ranges of a blob from its first bytes (header and plane table, kdn/blob.h):\n"
      "the header dict plus 'sections' ([begin, end) per checksummed section: 0 = header and table, then\n"
      "one per plane; empty for version 1), 'trailer' and 'total_bytes'.");
  m.def(
      "blob_verify_sections",
      [](py::handle blob, uint64_t first, uint64_t last) {
        ByteSpan span = bytes_from_object(blob, "blob");
        Status st;
        {
          py::gil_scoped_release release;
          st = blob_verify_sections(span.data, span.size, first, last);
        }
        if (!st.ok) throw BlobError(st.message, __FILE__, __LINE__);
      },
      py::arg("blob"), py::arg("first"), py::arg("last"),
      "Verify sections [first, last] (and section 0) of a version-2 blob of which only those bytes and\n"
      "the trailer need have arrived; raises BlobError.");

  m.def("buffer_live_bytes", &Buffer::live_bytes, "Bytes held by all live kdn buffers in this process.");
  m.def("eviction_policies", &eviction_policy_names);
  m.def(
      "owner_of_fingerprint",
      [](const py::bytes& fingerprint) {
        const std::string fp = fingerprint;
        KDN_CHECK_INPUT(fp.size() >= sizeof(uint64_t), "owner_of_fingerprint: a fingerprint of at least 8 bytes");
        uint64_t owner;
        std::memcpy(&owner, fp.data(), sizeof(owner));
        return owner;
      },
      py::arg("fingerprint"), "The tier owner (fair sharing, quotas) of the blobs a session with this fingerprint writes.");

  py::class_<MemoryStore, std::shared_ptr<MemoryStore>>(m, "MemoryStore",
                                                        "Host-memory blob store (thread-safe); see kdn/memory_store.h.")
      .def(py::init<uint64_t, std::string>(), py::arg("capacity_bytes"), py::arg("policy") = "lru")
      .def("put", [](MemoryStore& s, py::handle key, py::handle blob) {
            // keeps the GIL (microseconds; nothing under the store's lock takes it): a thread that
            // let it go would wait a switch interval (5 ms) for it back while vLLM's loop runs Python
            Key128 k = key_arg(key, "key");
            return s.put(k, buffer_from_object(blob));
          }, py::arg("key"), py::arg("blob"))
      .def("get", [](MemoryStore& s, py::handle key) -> py::object {
            BufferPtr buf = s.get(key_arg(key, "key"));
            if (!buf) return py::none();
            return py::cast(buf);
          }, py::arg("key"))
      .def("contains", [](const MemoryStore& s, py::handle key) { return s.contains(key_arg(key, "key")); })
      .def("__contains__", [](const MemoryStore& s, py::handle key) { return s.contains(key_arg(key, "key")); })
      .def("count_prefix", [](const MemoryStore& s, const py::list& keys) { return s.count_prefix(keys_arg(keys)); },
           py::arg("keys"))
      .def("remove", [](MemoryStore& s, py::handle key) {
            Key128 k = key_arg(key, "key");
            py::gil_scoped_release release;
            return s.remove(k);
          })
      .def("pin", [](MemoryStore& s, py::handle key, double ttl) { return s.pin(key_arg(key, "key"), ttl); },
           py::arg("key"), py::arg("ttl_seconds") = 0.0)
      .def("unpin", [](MemoryStore& s, py::handle key) { return s.unpin(key_arg(key, "key")); })
      .def("set_priority", [](MemoryStore& s, py::handle key, int priority) { return s.set_priority(key_arg(key, "key"), priority); },
           py::arg("key"), py::arg("priority"), "Order among its owner's entries: a lower priority leaves first (0: default).")
      .def("set_quota", [](MemoryStore& s, uint64_t owner, uint64_t bytes) { s.set_quota(owner, bytes); }, py::arg("owner"),
           py::arg("bytes"), "A byte quota for the blobs of `owner` (owner_of_fingerprint; 0: none).")
      .def("record_events", &MemoryStore::record_events, py::arg("on"),
           "Log every insert and removal from now on (off: nothing logged), for take_events.")
      .def("take_events", [](MemoryStore& s) { return events_list(s.take_events()); },
           "[(stored, key), ...] since the last call, in order (stored False: removed).")
      .def("clear", &MemoryStore::clear, py::call_guard<py::gil_scoped_release>())
      .def("spill_to", [](MemoryStore& s, std::shared_ptr<DiskStore> disk) {
            if (!disk) return s.set_spill(nullptr);
            s.set_spill([disk](const Key128& k, const BufferPtr& b) { disk->put_async(k, b); });
          }, py::arg("disk"), "Send evicted entries to a disk store's write-behind queue (None: drop them).")
      .def("entries", [](const MemoryStore& s) {
            py::list out;
            for (const auto& [k, b] : s.entries())
              out.append(py::make_tuple(py::bytes(reinterpret_cast<const char*>(k.data()), 16), b));
            return out;
          }, "A snapshot [(key, Buffer)] of every entry.")
      .def("__len__", [](const MemoryStore& s) { return s.stats().entries; })
      .def_property_readonly("capacity", &MemoryStore::capacity)
      .def_property_readonly("policy", &MemoryStore::policy)
      .def_property_readonly("used_bytes", [](const MemoryStore& s) { return s.stats().used_bytes; })
      .def("stats", [](const MemoryStore& s) { return tier_stats_dict(s.stats()); });

  py::class_<DiskStore, std::shared_ptr<DiskStore>>(m, "DiskStore",
                                                    "Local-disk blob store (thread-safe); see kdn/disk_store.h.")
      .def(py::init([](const std::string& dir, uint64_t capacity, const std::string& policy, uint64_t queue_bytes,
                       int read_threads, bool fsync, int codec, uint32_t codec_params, py::bytes mac_key,
                       bool group_shared, bool read_only) {
             codec_require(codec, codec_params);
             KDN_CHECK_INPUT(read_threads >= 1 && read_threads <= 256, "DiskStore: read_threads must be in [1, 256]");
             DiskStoreOptions o{dir, capacity, policy, queue_bytes, read_threads, fsync, static_cast<uint8_t>(codec),
                                codec_params, std::string(mac_key), group_shared, read_only};
             py::gil_scoped_release release;  // the index rebuild scans the directory
             return std::make_shared<DiskStore>(o);
           }),
           py::arg("dir"), py::arg("capacity_bytes"), py::arg("policy") = "lru",
           py::arg("queue_bytes") = 512ull << 20, py::arg("read_threads") = 4, py::arg("fsync") = true,
           py::arg("codec") = 0, py::arg("codec_params") = 0, py::arg("mac_key") = py::bytes(),
           py::arg("group_shared") = false, py::arg("read_only") = false)
      .def("put", [](DiskStore& s, py::handle key, py::handle blob) {
            Key128 k = key_arg(key, "key");
            BufferPtr buf = buffer_from_object(blob);
            py::gil_scoped_release release;
            return s.put(k, buf);
          }, py::arg("key"), py::arg("blob"))
      .def("put_async", [](DiskStore& s, py::handle key, py::handle blob) {
            Key128 k = key_arg(key, "key");  // queued (or dropped when full), never waits: keeps the GIL
            return s.put_async(k, buffer_from_object(blob));
          }, py::arg("key"), py::arg("blob"))
      .def("flush", [](DiskStore& s, double timeout) {
            if (timeout < 0) {
              s.flush();
              return true;
            }
            return s.flush_for(timeout);
          }, py::arg("timeout") = -1.0, py::call_guard<py::gil_scoped_release>(),
          "Wait until queued writes are on disk (at most `timeout` s if >= 0); True if drained.")
      .def("get", [](DiskStore& s, py::handle key) -> py::object {
            Key128 k = key_arg(key, "key");
            BufferPtr buf;
            {
              py::gil_scoped_release release;
              buf = s.get(k);
            }
            if (!buf) return py::none();
            return py::cast(buf);
          }, py::arg("key"))
      .def("get_many", [](DiskStore& s, const py::list& keys, const py::object& sections) {
            std::vector<Key128> ks = keys_arg(keys);
            std::vector<std::vector<std::pair<uint64_t, uint64_t>>> spans;
            if (!sections.is_none()) {
              spans = sections.cast<std::vector<std::vector<std::pair<uint64_t, uint64_t>>>>();
              KDN_CHECK_INPUT(spans.size() == ks.size(), "DiskStore.get_many: one list of sections per key");
            }
            std::vector<BufferPtr> bufs;
            {
              py::gil_scoped_release release;
              bufs = sections.is_none() ? s.get_many(ks) : s.get_many(ks, spans);
            }
            py::list out;
            for (auto& b : bufs) out.append(b ? py::cast(b) : py::none());
            return out;
          }, py::arg("keys"), py::arg("sections") = py::none(),
          "Blobs of `keys` read in parallel (None for a miss); `sections`: per key, inclusive ranges of\n"
          "its sections to read alone (a Buffer marked partial: only those, section 0 and the trailer are\n"
          "its own, verified), or [] for the whole blob.")
      .def("contains", [](DiskStore& s, py::handle key) {
            Key128 k = key_arg(key, "key");
            py::gil_scoped_release release;
            return s.contains(k);
          })
      .def("__contains__", [](DiskStore& s, py::handle key) {
            Key128 k = key_arg(key, "key");
            py::gil_scoped_release release;
            return s.contains(k);
          })
      .def("count_prefix", [](DiskStore& s, const py::list& keys) {
            std::vector<Key128> ks = keys_arg(keys);
            py::gil_scoped_release release;
            return s.count_prefix(ks);
          }, py::arg("keys"))
      .def("remove", [](DiskStore& s, py::handle key) {
            Key128 k = key_arg(key, "key");
            py::gil_scoped_release release;
            return s.remove(k);
          })
      .def("pin", [](DiskStore& s, py::handle key, double ttl) { return s.pin(key_arg(key, "key"), ttl); },
           py::arg("key"), py::arg("ttl_seconds") = 0.0)
      .def("unpin", [](DiskStore& s, py::handle key) { return s.unpin(key_arg(key, "key")); })
      .def("set_priority", [](DiskStore& s, py::handle key, int priority) { return s.set_priority(key_arg(key, "key"), priority); },
           py::arg("key"), py::arg("priority"), "Order among its owner's entries: a lower priority leaves first (0: default).")
      .def("set_quota", [](DiskStore& s, uint64_t owner, uint64_t bytes) { s.set_quota(owner, bytes); }, py::arg("owner"),
           py::arg("bytes"), "A byte quota for the blobs of `owner` (owner_of_fingerprint; 0: none).")
      .def("record_events", &DiskStore::record_events, py::arg("on"),
           "Log every insert and removal from now on (off: nothing logged), for take_events.")
      .def("take_events", [](DiskStore& s) { return events_list(s.take_events()); },
           "[(stored, key), ...] since the last call, in order (stored False: removed).")
      .def("clear", &DiskStore::clear, py::call_guard<py::gil_scoped_release>())
      .def("path_of", [](const DiskStore& s, py::handle key) { return s.path_of(key_arg(key, "key")); })
      .def("_inject_write_failures", &DiskStore::inject_write_failures, py::arg("n"),
           "Test hook: the next n file writes fail as if the disk were full.")
      .def("__len__", [](const DiskStore& s) { return s.stats().entries; })
      .def_property_readonly("capacity", [](const DiskStore& s) { return s.options().capacity_bytes; })
      .def_property_readonly("directory", [](const DiskStore& s) { return s.options().dir; })
      .def_property_readonly("policy", [](const DiskStore& s) { return s.options().policy; })
      .def_property_readonly("used_bytes", [](const DiskStore& s) { return s.stats().used_bytes; })
      .def("stats", [](const DiskStore& s) {
        DiskStats st = s.stats();
        py::dict d = tier_stats_dict(st);
        d["writes"] = st.writes;
        d["errors"] = st.errors;
        d["corrupt"] = st.corrupt;
        d["dropped"] = st.dropped;
        d["adopted"] = st.adopted;
        d["foreign"] = st.foreign;
        d["unindexed"] = st.unindexed;
        d["vanished"] = st.vanished;
        d["queued_entries"] = st.queued_entries;
        d["queued_bytes"] = st.queued_bytes;
        d["read_bytes"] = st.read_bytes;
        d["last_error"] = st.last_error;
        return d;
      });
}

}  // namespace kdn
