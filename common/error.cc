#include "common/error.h"

namespace ctorchrun::detail {

void check_failed(const char* file, int line, const char* cond, const std::string& msg) {
  throw InternalError(std::string("internal error at ") + file + ":" + std::to_string(line) +
                      ": check '" + cond + "' failed: " + msg + " (please report this)");
}

}  // namespace ctorchrun::detail
