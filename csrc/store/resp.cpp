// Pipelined Redis GETs and GETRANGEs into pooled Buffers, SETs from the caller's memory (kdn/resp.h).
#include "kdn/resp.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>

namespace kdn {
namespace {

constexpr size_t kReadChunk = 1 << 16;
constexpr size_t kMaxParts = 1024;  // iovecs per sendmsg (Linux's IOV_MAX)
constexpr int64_t kMaxBulk = int64_t(1) << 32;  // a value this tier wrote is at most part_bytes (16 MiB)

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A bulk string's length line; its bytes and a CRLF follow.
void append_bulk_length(std::string& out, size_t size) {
  out += "$" + std::to_string(size) + "\r\n";
}

void append_bulk(std::string& out, const std::string& a) {
  append_bulk_length(out, a.size());
  out += a;
  out += "\r\n";
}

void append_command(std::string& out, const std::vector<std::string>& args) {
  out += "*" + std::to_string(args.size()) + "\r\n";
  for (const auto& a : args) append_bulk(out, a);
}

int connect_socket(const std::string& host, int port, int timeout_ms) {
  int fd = -1;
  if (port < 0) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (host.size() >= sizeof(addr.sun_path)) throw RespIOError("unix socket path too long: " + host);
    std::memcpy(addr.sun_path, host.c_str(), host.size() + 1);
    fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      const std::string why = std::strerror(errno);
      ::close(fd);
      throw RespIOError("connect " + host + ": " + why);
    }
  } else {
    addrinfo hints{}, *found = nullptr;
    hints.ai_socktype = SOCK_STREAM;
    const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
    if (rc != 0) throw RespIOError("resolve " + host + ": " + gai_strerror(rc));
    std::string why = "no address";
    for (addrinfo* a = found; a; a = a->ai_next) {
      fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      timeval tv{timeout_ms / 1000, (timeout_ms % 1000) * 1000};
      ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));  // bounds connect too on Linux
      if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) break;
      why = std::strerror(errno);
      ::close(fd);
      fd = -1;
    }
    ::freeaddrinfo(found);
    if (fd < 0) throw RespIOError("connect " + host + ":" + std::to_string(port) + ": " + why);
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  if (fd < 0) throw RespIOError(std::string("socket: ") + std::strerror(errno));
  // non-blocking from here: every send and receive waits in poll() for what is left of its call's deadline
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  return fd;
}

}  // namespace

RespConnection::RespConnection(const std::string& host, int port, int timeout_ms, const std::string& user,
                               const std::string& password, int db)
    : fd_(connect_socket(host, port, timeout_ms)), timeout_ms_(timeout_ms), buf_(kReadChunk) {
  deadline_ms_ = now_ms() + timeout_ms_;
  std::string hello;
  int replies = 0;
  if (!password.empty()) {
    append_command(hello, user.empty() ? std::vector<std::string>{"AUTH", password}
                                       : std::vector<std::string>{"AUTH", user, password});
    ++replies;
  }
  if (db > 0) {
    append_command(hello, {"SELECT", std::to_string(db)});
    ++replies;
  }
  if (replies) {
    send_all(hello);
    for (int i = 0; i < replies; ++i) expect_ok();
  }
}

RespConnection::~RespConnection() {
  if (fd_ >= 0) ::close(fd_);
}

void RespConnection::fail(const std::string& why) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  throw RespIOError(why);
}

void RespConnection::start_call() {
  if (fd_ < 0) throw RespIOError("connection closed");
  if (!in_step()) fail("the server sent bytes nobody asked for (its replies are out of step)");
  deadline_ms_ = now_ms() + timeout_ms_;
}

bool RespConnection::in_step() {
  if (fd_ < 0 || head_ != tail_) return false;
  char c;
  const ssize_t n = ::recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);  // 0: closed by the server; > 0: unread bytes
}

void RespConnection::wait_for(short events) {
  for (;;) {
    const int64_t left = deadline_ms_ - now_ms();
    if (left <= 0) fail("timed out: the call took more than " + std::to_string(timeout_ms_) + " ms");
    pollfd p{fd_, events, 0};
    const int rc = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left, INT_MAX)));
    if (rc > 0) return;
    if (rc < 0 && errno != EINTR) fail(std::string("poll: ") + std::strerror(errno));
  }
}

void RespConnection::send_all(const std::string& data) {
  send_all({iovec{const_cast<char*>(data.data()), data.size()}});
}

void RespConnection::send_all(std::vector<iovec> parts) {
  if (fd_ < 0) throw RespIOError("connection closed");
  size_t i = 0;
  for (;;) {
    while (i < parts.size() && parts[i].iov_len == 0) ++i;
    if (i == parts.size()) return;
    msghdr msg{};
    msg.msg_iov = &parts[i];
    msg.msg_iovlen = std::min(parts.size() - i, kMaxParts);
    const ssize_t n = ::sendmsg(fd_, &msg, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      wait_for(POLLOUT);
      continue;
    }
    if (n <= 0) fail(std::string("send: ") + (n < 0 ? std::strerror(errno) : "closed"));
    for (size_t left = static_cast<size_t>(n); left > 0;) {  // skip what went out; trim a part sent in part
      const size_t step = std::min(left, parts[i].iov_len);
      parts[i].iov_base = static_cast<char*>(parts[i].iov_base) + step;
      parts[i].iov_len -= step;
      left -= step;
      if (parts[i].iov_len == 0) ++i;
    }
  }
}

void RespConnection::fill() {
  if (head_ == tail_) head_ = tail_ = 0;
  if (tail_ == buf_.size()) {  // compact (lines are capped far below the buffer's size)
    std::memmove(buf_.data(), buf_.data() + head_, tail_ - head_);
    tail_ -= head_;
    head_ = 0;
    if (tail_ == buf_.size()) fail("read buffer full");
  }
  for (;;) {
    const ssize_t n = ::recv(fd_, buf_.data() + tail_, buf_.size() - tail_, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      wait_for(POLLIN);
      continue;
    }
    if (n <= 0) fail(std::string("recv: ") + (n < 0 ? std::strerror(errno) : "connection closed by the server"));
    tail_ += static_cast<size_t>(n);
    return;
  }
}

std::string RespConnection::read_line() {
  size_t scanned = head_;
  for (;;) {
    for (size_t i = scanned; i + 1 < tail_; ++i)
      if (buf_[i] == '\r' && buf_[i + 1] == '\n') {
        std::string line(reinterpret_cast<const char*>(buf_.data() + head_), i - head_);
        head_ = i + 2;
        return line;
      }
    if (tail_ - head_ > kMaxLine) fail("a reply line longer than " + std::to_string(kMaxLine) + " bytes");
    scanned = tail_ > head_ ? tail_ - 1 : head_;
    const size_t offset = scanned - head_;
    fill();
    scanned = head_ + offset;
  }
}

void RespConnection::expect_ok() {
  const std::string line = read_line();
  if (!line.empty() && line[0] == '-') throw RespError(line.substr(1));
  if (line != "+OK") fail("unexpected reply: " + line.substr(0, 80));
}

BufferPtr RespConnection::read_bulk(int64_t max_bytes) {
  const std::string line = read_line();
  if (line.empty()) fail("empty reply line");
  if (line[0] == '-') throw RespError(line.substr(1));
  if (line[0] != '$') fail("expected a bulk string, got: " + line.substr(0, 80));
  return bulk_after(line, max_bytes);
}

int64_t RespConnection::reply_number(const std::string& line) {
  char* end = nullptr;
  const long long n = std::strtoll(line.c_str() + 1, &end, 10);
  if (end == line.c_str() + 1 || *end != '\0') fail("bad reply: " + line.substr(0, 80));
  return n;
}

BufferPtr RespConnection::bulk_after(const std::string& line, int64_t max_bytes) {
  const int64_t n = reply_number(line);
  if (n < -1) fail("bad bulk length: " + line.substr(0, 80));
  if (n > max_bytes) fail("a reply of " + std::to_string(n) + " bytes to a request for at most " + std::to_string(max_bytes));
  if (n == -1) return nullptr;
  auto out = std::make_shared<Buffer>(static_cast<size_t>(n));
  uint8_t* dst = out->data();
  size_t have = std::min(static_cast<size_t>(n), tail_ - head_);
  std::memcpy(dst, buf_.data() + head_, have);
  head_ += have;
  while (have < static_cast<size_t>(n)) {  // the rest straight from the socket into the Buffer
    const ssize_t got = ::recv(fd_, dst + have, static_cast<size_t>(n) - have, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      wait_for(POLLIN);
      continue;
    }
    if (got <= 0) fail(std::string("recv: ") + (got < 0 ? std::strerror(errno) : "connection closed by the server"));
    have += static_cast<size_t>(got);
  }
  while (tail_ - head_ < 2) fill();
  if (buf_[head_] != '\r' || buf_[head_ + 1] != '\n') fail("bulk string not followed by CRLF");
  head_ += 2;
  return out;
}

std::vector<BufferPtr> RespConnection::pipelined(const std::string& request, size_t replies, int64_t max_bytes) {
  start_call();
  send_all(request);
  std::vector<BufferPtr> out;
  out.reserve(replies);
  std::string error;
  for (size_t i = 0; i < replies; ++i) {
    try {
      out.push_back(read_bulk(max_bytes));
    } catch (const RespError& e) {  // read every reply before reporting, so the stream stays in step
      if (error.empty()) error = e.what();
      out.push_back(nullptr);
    }
  }
  if (head_ != tail_) fail("more replies than requests (the server's replies are out of step)");
  if (!error.empty()) throw RespError(error);
  return out;
}

std::vector<BufferPtr> RespConnection::get_many(const std::vector<std::string>& names, int64_t max_bytes) {
  std::string request;
  for (const auto& name : names)
    append_command(request, max_bytes > 0 ? std::vector<std::string>{"GETRANGE", name, "0", std::to_string(max_bytes)}
                                          : std::vector<std::string>{"GET", name});
  std::vector<BufferPtr> out = pipelined(request, names.size(), max_bytes > 0 ? max_bytes + 1 : kMaxBulk);
  if (max_bytes > 0)
    for (auto& v : out)
      if (v && v->size() == 0) v = nullptr;  // GETRANGE answers "" for a missing key; kdn writes no empty values
  return out;
}

std::vector<BufferPtr> RespConnection::get_ranges(const std::vector<Range>& ranges) {
  std::string request;
  int64_t most = 0;  // the longest range asked: no reply may be longer
  for (const auto& r : ranges) {
    append_command(request, {"GETRANGE", r.name, std::to_string(r.start), std::to_string(r.end)});
    most = std::max(most, r.start >= 0 && r.end >= 0 ? std::max<int64_t>(0, r.end - r.start + 1) : kMaxBulk);
  }
  std::vector<BufferPtr> out = pipelined(request, ranges.size(), most);
  for (auto& v : out)
    if (!v) fail("GETRANGE answered nil");  // the server answers "" for a missing key
  return out;
}

void RespConnection::set_many(const std::vector<Value>& items, int64_t ttl_ms) {
  std::string tail = "\r\n";  // after each value: its CRLF, then PX ttl
  if (ttl_ms > 0) {
    append_bulk(tail, "PX");
    append_bulk(tail, std::to_string(ttl_ms));
  }
  std::vector<std::string> heads(items.size());  // each command up to its value
  std::vector<iovec> parts;
  parts.reserve(3 * items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    heads[i] = ttl_ms > 0 ? "*5\r\n" : "*3\r\n";
    append_bulk(heads[i], "SET");
    append_bulk(heads[i], items[i].name);
    append_bulk_length(heads[i], items[i].size);
    parts.push_back({heads[i].data(), heads[i].size()});
    parts.push_back({const_cast<uint8_t*>(items[i].data), items[i].size});
    parts.push_back({tail.data(), tail.size()});
  }
  start_call();
  send_all(std::move(parts));
  std::string error;
  for (size_t i = 0; i < items.size(); ++i) {
    try {
      expect_ok();
    } catch (const RespError& e) {  // read every reply before reporting, so the stream stays in step
      if (error.empty()) error = e.what();
    }
  }
  if (head_ != tail_) fail("more replies than requests (the server's replies are out of step)");
  if (!error.empty()) throw RespError(error);
}

std::vector<RespConnection::Reply> RespConnection::commands(const std::vector<std::vector<std::string>>& cmds) {
  std::string request;
  for (const auto& c : cmds) append_command(request, c);
  start_call();
  send_all(request);
  std::vector<Reply> out;
  out.reserve(cmds.size());
  std::string error;
  for (size_t i = 0; i < cmds.size(); ++i) {
    const std::string line = read_line();
    if (line.empty()) fail("empty reply line");
    Reply r{Reply::kNil, 0, {}};
    if (line[0] == '-') {  // read every reply before reporting, so the stream stays in step
      if (error.empty()) error = line.substr(1);
    } else if (line[0] == ':') {
      r = Reply{Reply::kInteger, reply_number(line), {}};
    } else if (line[0] == '$') {
      if (BufferPtr bulk = bulk_after(line, kMaxSmallBulk))
        r = Reply{Reply::kBulk, 0, std::string(reinterpret_cast<const char*>(bulk->data()), bulk->size())};
    } else if (line[0] == '+') {
      r = Reply{Reply::kStatus, 0, line.substr(1)};
    } else {
      fail("unexpected reply: " + line.substr(0, 80));
    }
    out.push_back(std::move(r));
  }
  if (head_ != tail_) fail("more replies than requests (the server's replies are out of step)");
  if (!error.empty()) throw RespError(error);
  return out;
}

}  // namespace kdn
