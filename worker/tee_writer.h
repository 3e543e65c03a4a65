#pragma once

// Internal to worker/: what happens to the bytes of one worker stream that
// the launcher reads from a pipe (teed, or redirected to its file only). The
// launcher reads the worker's pipe and hands every chunk to write(); the
// stream's end to finish().
//
//  - The file gets the bytes unchanged, chunk by chunk.
//  - The console (when there is one) gets complete lines only, each as
//    prefix + line + '\n' in one string, handed to `console` (the launcher
//    queues it on worker::Console, which writes it with a single write(), so
//    lines of several workers sharing the console never interleave mid-line).
//  - finish() hands on a last line without '\n' with one appended.
//  - A line longer than kMaxLine reaches the console in pieces of kMaxLine
//    bytes, each as a line: memory stays bounded. A '\n' right after a piece
//    ends that line; it adds no empty line.
//
// A failing file write (a full disk, a file size limit) ends file output
// for the rest of the stream and is handed to `on_file_error` once, with
// errno's value. Descriptors are not owned. Not thread-safe.

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

namespace ctorchrun::worker::detail {

class TeeWriter {
 public:
  static constexpr size_t kMaxLine = 1 << 20;

  using ConsoleLine = std::function<void(std::string line)>;
  using FileError = std::function<void(int error)>;

  // file_fd: -1 for none. console: empty for none.
  TeeWriter(int file_fd, ConsoleLine console, std::string prefix, FileError on_file_error = {});

  void write(const char* data, size_t size);
  void finish();

 private:
  void console_line(const char* data, size_t size);

  int file_fd_;
  ConsoleLine console_;
  std::string prefix_;
  FileError on_file_error_;
  std::string partial_;       // console bytes after the last '\n'
  bool after_piece_ = false;  // the last console line was a kMaxLine piece
};

// torch main's duplicate filters: a line holding any of `filters` (after its
// console prefix) is appended to `path` (opened O_APPEND on first use, so
// that the workers of an attempt share the file a whole line at a time). A
// failing open or write is handed to `on_error` once and ends the copying.
class LineFilter {
 public:
  using FileError = std::function<void(int error)>;
  LineFilter(std::vector<std::string> filters, std::string path, FileError on_error);
  ~LineFilter();
  LineFilter(const LineFilter&) = delete;
  LineFilter& operator=(const LineFilter&) = delete;

  // `line`: prefix (`prefix_size` bytes) + the worker's line + '\n'.
  void offer(const std::string& line, size_t prefix_size);

 private:
  std::vector<std::string> filters_;
  std::string path_;
  FileError on_error_;
  int fd_ = -1;
  bool failed_ = false;
};

// Writes all of [data, data+size) to fd, retrying on EINTR, partial writes
// and EAGAIN (waiting for the descriptor to become writable). False on error,
// with errno set.
bool write_all(int fd, const char* data, size_t size);

}  // namespace ctorchrun::worker::detail
