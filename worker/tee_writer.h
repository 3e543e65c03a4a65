#pragma once

// Internal to worker/: what happens to the bytes of one teed (or redirected
// through a pipe) worker stream. The launcher reads the worker's pipe and
// hands every chunk to write(); the stream's end to finish().
//
//  - The file gets the bytes unchanged, chunk by chunk.
//  - The console gets complete lines only, each as prefix + line + '\n' in a
//    single write(), so lines of several workers sharing the console never
//    interleave mid-line (a write of up to PIPE_BUF bytes to a pipe is
//    atomic; terminals and files take a write whole in practice).
//  - finish() writes a last line without '\n' with one appended.
//  - A line longer than kMaxLine reaches the console in pieces of kMaxLine
//    bytes, each written as a line: memory stays bounded.
//
// A failing write (a full disk, a closed console pipe) disables that
// destination for the rest of the stream and is logged once at debug; the
// other destination carries on. Descriptors are not owned. Not thread-safe.

#include <cstddef>
#include <string>

namespace ctorchrun::worker::detail {

class TeeWriter {
 public:
  static constexpr size_t kMaxLine = 1 << 20;

  // file_fd / console_fd: -1 for none.
  TeeWriter(int file_fd, int console_fd, std::string prefix);

  void write(const char* data, size_t size);
  void finish();

 private:
  void console_line(const char* data, size_t size);

  int file_fd_;
  int console_fd_;
  std::string prefix_;
  std::string partial_;  // console bytes after the last '\n'
  std::string line_;     // reused buffer for one console write
};

// Writes all of [data, data+size) to fd, retrying on EINTR, partial writes
// and EAGAIN (waiting for the descriptor to become writable). False on error.
bool write_all(int fd, const char* data, size_t size);

}  // namespace ctorchrun::worker::detail
