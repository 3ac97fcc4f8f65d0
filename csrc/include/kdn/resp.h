// The remote tier's reads and writes at memory speed: pipelined Redis GETs and GETRANGEs over one
// socket, each bulk reply received straight into a pooled Buffer, and pipelined SETs sent straight
// from the caller's memory (no intermediate copies, no per-value Python bytes).
//
// A minimal RESP2 client for one connection (TCP or a unix socket, plain text: TLS and cluster
// URLs stay on redis-py). Not thread-safe: one connection per caller thread (the Python side pools
// them). A socket failure or a malformed reply throws RespIOError and closes the connection; an
// error reply (-ERR ...) throws RespError with the server's text (the connection stays usable).
//
// The server is not trusted: each call (not each recv) has a deadline of timeout_ms; a reply line
// longer than kMaxLine, a bulk reply larger than what was asked, or bytes nobody asked for (an
// extra reply: the stream is out of step) close the connection with a RespIOError.
#pragma once

#include <sys/uio.h>

#include <cstdint>

#include <stdexcept>
#include <string>
#include <vector>

#include "kdn/blob.h"
#include "kdn/common.h"

namespace kdn {

class RespError : public std::runtime_error {  // the server answered with an error reply
 public:
  using std::runtime_error::runtime_error;
};

class RespIOError : public std::runtime_error {  // the connection failed (closed, timed out, garbled)
 public:
  using std::runtime_error::runtime_error;
};

class RespConnection {
 public:
  static constexpr size_t kMaxLine = 4096;  // the RESP lines kdn reads are < 100 bytes (error text: more)

  // host:port, or a unix socket path when port < 0. timeout_ms bounds each call, start to end.
  // With a password, AUTH [user] password; with db > 0, SELECT db.
  RespConnection(const std::string& host, int port, int timeout_ms, const std::string& user,
                 const std::string& password, int db);
  ~RespConnection();
  RespConnection(const RespConnection&) = delete;
  RespConnection& operator=(const RespConnection&) = delete;

  // GET of every name in one round trip: a Buffer per value, nullptr for a missing key. With
  // max_bytes > 0, GETRANGE name 0 max_bytes instead: at most max_bytes + 1 bytes of any value
  // (an empty value reads as missing).
  std::vector<BufferPtr> get_many(const std::vector<std::string>& names, int64_t max_bytes = 0);
  // GETRANGE name start end (both inclusive; negative: from the value's end) of every request in
  // one round trip: a Buffer per range (empty for a missing key, as the server answers).
  struct Range {
    std::string name;
    int64_t start, end;
  };
  std::vector<BufferPtr> get_ranges(const std::vector<Range>& ranges);
  // SET name value [PX ttl_ms] (PX when ttl_ms > 0) of every item in one round trip, each value
  // sent from the caller's memory, which must stay valid for the call. The first error reply is
  // thrown (RespError) after every reply has been read.
  struct Value {
    std::string name;
    const uint8_t* data;
    size_t size;
  };
  void set_many(const std::vector<Value>& items, int64_t ttl_ms);
  // Any small commands (EXISTS, SET NX PX, PTTL, DEL, PING) in one round trip, under the same
  // deadline and bounds: a Reply per command (an integer, a status line, a bulk string of at most
  // kMaxSmallBulk bytes, or nil). The first error reply is thrown (RespError) after every reply is read.
  static constexpr int64_t kMaxSmallBulk = kMaxLine;
  struct Reply {
    enum Kind { kInteger, kStatus, kBulk, kNil } kind;
    int64_t integer = 0;
    std::string text;  // a status line's text, or a bulk string's bytes
  };
  std::vector<Reply> commands(const std::vector<std::vector<std::string>>& commands);
  bool open() const { return fd_ >= 0; }
  // Open, with nothing unread: no byte in the buffer or waiting on the socket (a pooled connection
  // that is not in step is dropped before use).
  bool in_step();

 private:
  void send_all(const std::string& data);
  void send_all(std::vector<iovec> parts);  // in order, resuming after partial sends
  void start_call();                        // a new call: sets the deadline; fails unless in step
  void wait_for(short events);              // poll until ready or the call's deadline (then fail)
  void fill();                              // at least one more byte into the read buffer
  std::string read_line();                  // up to CRLF, without it
  BufferPtr read_bulk(int64_t max_bytes);   // one reply: a bulk string (at most max_bytes), nil, or an error
  BufferPtr bulk_after(const std::string& line, int64_t max_bytes);  // the body of a "$n" reply line (nil: nullptr)
  int64_t reply_number(const std::string& line);  // the number after a reply line's type byte
  // send, read every bulk reply (each at most max_bytes), then check nothing more came
  std::vector<BufferPtr> pipelined(const std::string& request, size_t replies, int64_t max_bytes);
  void expect_ok();
  [[noreturn]] void fail(const std::string& why);  // close, throw RespIOError

  int fd_ = -1;
  int timeout_ms_;
  int64_t deadline_ms_ = 0;                 // of the call in progress (steady clock)
  std::vector<uint8_t> buf_;
  size_t head_ = 0, tail_ = 0;              // unread bytes: buf_[head_, tail_)
};

}  // namespace kdn
