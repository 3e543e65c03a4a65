#pragma once

#include <string>

namespace ctorchrun::agent {

// The live page GET / serves: self-contained HTML that draws GET /status.
const std::string& status_page_html();

}  // namespace ctorchrun::agent
