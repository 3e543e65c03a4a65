/* membw: this machine's memory-bandwidth floor for the collective benchmark,
 * STREAM's way: a streaming copy (b = a, memcpy: 2 x size bytes moved) and a
 * streaming add (c = a + b over float32: 3 x size bytes moved) over arrays
 * far larger than the caches; the best of --reps runs (default 5). One JSON
 * line: copy_GBps, add_GBps, bytes (of one array).
 *   build/bin/ctorch-membw [--mib 128] [--reps 5]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  size_t mib = 128;
  int reps = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (strcmp(argv[i], "--mib") == 0) mib = (size_t)atoi(argv[i + 1]);
    if (strcmp(argv[i], "--reps") == 0) reps = atoi(argv[i + 1]);
  }
  const size_t bytes = mib << 20;
  const size_t n = bytes / sizeof(float);
  float* a = malloc(bytes);
  float* b = malloc(bytes);
  float* c = malloc(bytes);
  if (!a || !b || !c) return 1;
  for (size_t i = 0; i < n; ++i) {
    a[i] = (float)(i & 1023);
    b[i] = 1.0f;
    c[i] = 0.0f;
  }
  double copy = 1e30, add = 1e30;
  for (int r = 0; r < reps; ++r) {
    double t = now();
    memcpy(b, a, bytes);
    t = now() - t;
    if (t < copy) copy = t;
    t = now();
    for (size_t i = 0; i < n; ++i) c[i] = a[i] + b[i];
    t = now() - t;
    if (t < add) add = t;
  }
  /* Use the results so that the loops stay. */
  volatile float sink = c[n / 2] + b[n / 3];
  (void)sink;
  printf("{\"copy_GBps\":%.3f,\"add_GBps\":%.3f,\"bytes\":%zu}\n", 2.0 * (double)bytes / copy / 1e9,
         3.0 * (double)bytes / add / 1e9, bytes);
  free(a);
  free(b);
  free(c);
  return 0;
}
