/* mpi_collective_bench: the Open MPI peer of ctorch-collective-bench, with
 * the same sizes and definitions (nccl-tests'): float32 sum, sizes doubling
 * from --min-bytes to --max-bytes, "bytes" the buffer for all_reduce,
 * broadcast and reduce, the whole output for all_gather, the whole input for
 * reduce_scatter; time_us the mean over the timed calls of the slowest
 * rank; busbw = algbw x 2(n-1)/n (all_reduce), (n-1)/n (all_gather,
 * reduce_scatter), 1 (broadcast, reduce). Rank 0 prints one JSON object a
 * size. Iterations: 2^30 / bytes clamped to 5..1000, after a tenth as many
 * warm-up calls (at least 2), as ctorch-collective-bench.
 *
 *   mpirun --oversubscribe --allow-run-as-root -np 2 build/bin/ctorch-mpi-bench \
 *     --op all_reduce --min-bytes 4 --max-bytes 256M
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t parse_size(const char* text) {
  char* end = NULL;
  uint64_t v = strtoull(text, &end, 10);
  if (*end == 'K') v <<= 10;
  if (*end == 'M') v <<= 20;
  if (*end == 'G') v <<= 30;
  return v;
}

int main(int argc, char** argv) {
  const char* op = "all_reduce";
  uint64_t min_bytes = 4, max_bytes = 64u << 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (strcmp(argv[i], "--op") == 0) op = argv[i + 1];
    else if (strcmp(argv[i], "--min-bytes") == 0) min_bytes = parse_size(argv[i + 1]);
    else if (strcmp(argv[i], "--max-bytes") == 0) max_bytes = parse_size(argv[i + 1]);
  }
  MPI_Init(&argc, &argv);
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const int gather = strcmp(op, "all_gather") == 0;
  const int scatter = strcmp(op, "reduce_scatter") == 0;
  const double n = world;
  double factor = 1;
  if (strcmp(op, "all_reduce") == 0) factor = 2 * (n - 1) / n;
  if (gather || scatter) factor = (n - 1) / n;
  int failed = 0;
  for (uint64_t bytes = min_bytes < 4 ? 4 : min_bytes; bytes <= max_bytes; bytes *= 2) {
    size_t count = bytes / 4; /* elements of the in-place buffer, or of the whole */
    size_t per = count / (size_t)world;
    if ((gather || scatter) && per == 0) continue;
    if (gather || scatter) count = per * (size_t)world;
    float* in = malloc(count * sizeof(float));
    float* out = malloc(count * sizeof(float));
    for (size_t i = 0; i < count; ++i) in[i] = out[i] = (float)(rank + 1);
    const size_t real = count * sizeof(float);
    uint64_t it = ((uint64_t)1 << 30) / real;
    const int iters = it < 5 ? 5 : it > 1000 ? 1000 : (int)it;
    const int warmup = iters / 10 > 2 ? iters / 10 : 2;
    double start = 0;
    for (int i = -warmup; i < iters; ++i) {
      if (i == 0) {
        MPI_Barrier(MPI_COMM_WORLD);
        start = MPI_Wtime();
      }
      if (strcmp(op, "all_reduce") == 0) {
        MPI_Allreduce(MPI_IN_PLACE, out, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      } else if (strcmp(op, "broadcast") == 0) {
        MPI_Bcast(out, (int)count, MPI_FLOAT, 0, MPI_COMM_WORLD);
      } else if (strcmp(op, "reduce") == 0) {
        MPI_Reduce(rank == 0 ? MPI_IN_PLACE : out, out, (int)count, MPI_FLOAT, MPI_SUM, 0,
                   MPI_COMM_WORLD);
      } else if (gather) {
        MPI_Allgather(in, (int)per, MPI_FLOAT, out, (int)per, MPI_FLOAT, MPI_COMM_WORLD);
      } else if (scatter) {
        MPI_Reduce_scatter_block(in, out, (int)per, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      } else {
        if (rank == 0) fprintf(stderr, "mpi_collective_bench: unknown --op %s\n", op);
        failed = 1;
        break;
      }
    }
    double time_us = (MPI_Wtime() - start) * 1e6 / iters;
    MPI_Allreduce(MPI_IN_PLACE, &time_us, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    free(in);
    free(out);
    if (failed) break;
    const double algbw = (double)real / time_us / 1e3;
    if (rank == 0) {
      printf("{\"op\":\"%s\",\"bytes\":%zu,\"world\":%d,\"time_us\":%.3f,\"algbw_GBps\":%.6f,"
             "\"busbw_GBps\":%.6f,\"iters\":%d}\n",
             op, real, world, time_us, algbw, algbw * factor, iters);
      fflush(stdout);
    }
  }
  MPI_Finalize();
  return failed;
}
