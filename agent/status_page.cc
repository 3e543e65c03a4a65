#include "agent/status_page.h"

namespace ctorchrun::agent {

const std::string& status_page_html() {
  static const std::string page =
      "<!doctype html><html><head><meta charset=\"utf-8\"><title>ctorchrun</title></head>"
      "<body><pre id=\"status\"></pre><script>"
      "async function poll(){try{const r=await fetch('status',{cache:'no-store'});"
      "document.getElementById('status').textContent=JSON.stringify(await r.json(),null,1);}"
      "catch(e){document.getElementById('status').textContent='agent unreachable';}}"
      "poll();setInterval(poll,1000);</script></body></html>";
  return page;
}

}  // namespace ctorchrun::agent
