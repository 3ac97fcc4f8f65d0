// How many threads the core uses by default (kdn/parallel.h).
#include <thread>

#include "kdn/parallel.h"

namespace kdn {

int default_num_threads() {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n > 8 ? 8 : n);
}

}  // namespace kdn
