#pragma once

// Exit codes of ctorchrun's executables: a contract with users and scripts.

namespace ctorchrun {

enum ExitCode : int {
  kExitSuccess = 0,        // all local workers succeeded
  kExitWorkersFailed = 1,  // workers failed and restarts are exhausted
  kExitUsage = 2,          // usage or configuration error
  kExitRendezvous = 3,     // rendezvous failed, timed out, was closed, or its store was lost
  kExitStoreNetwork = 4,   // store or network set-up failed (bind, connect)
  kExitInternal = 70,      // internal error (a CTORCHRUN_CHECK failed): please report
  // Stopped by the scheduler (Slurm's scancel, preemption or time-limit
  // signal): not a failure; a job script may requeue on it. 75 is
  // sysexits.h's EX_TEMPFAIL, "try again later".
  kExitSchedulerStop = 75,
  kExitSignalBase = 128,  // 128+N: stopped by signal N
};

}  // namespace ctorchrun
