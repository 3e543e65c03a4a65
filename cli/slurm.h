#pragma once

// Running as a task of a Slurm job step: the job's topology read from the
// step's environment, so that `srun ctorchrun train.py` needs no rendezvous
// flag. Pure functions of their inputs (no environment, no network), so that
// every shape of allocation is testable without a cluster.

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace ctorchrun::cli {

// Expands a Slurm hostlist expression as Slurm's hostlist.c does (checked
// against `scontrol show hostnames`):
//   - items separated at top level by commas or white space; empty items skipped;
//   - "n[01-04,07]": a bracket holds comma-separated numbers or LO-HI ranges
//     (LO <= HI); a LO written with a leading zero ("01", "007") pads every
//     number of its range to LO's width, otherwise no padding;
//   - several brackets in one item are a product, leftmost varying slowest:
//     "r[1-2]-n[1-2]" is r1-n1 r1-n2 r2-n1 r2-n2;
//   - duplicates are kept, in order ("n1,n1" is two hosts).
// Throws ConfigError naming the expression for anything else: "n[3-1]", an
// empty or non-numeric range, unbalanced or nested brackets, text after the
// last bracket of an item (Slurm refuses "n[1-2]x" too), a range of more than
// 65536 hosts (Slurm's own limit) or more than 1,048,576 hosts in all.
std::vector<std::string> expand_hostlist(const std::string& expression);

enum class SlurmMode {
  kAuto,  // use the step's topology when run as a task of a step
  kOn,    // the same, and an error (exit 2) outside a step
  kOff,   // ignore Slurm's variables
};

// What the command line (a flag or its PET_ variable) already decided: Slurm
// fills only the values left open.
struct SlurmGiven {
  bool nnodes = false;
  bool node_rank = false;
  bool nproc_per_node = false;
  bool master_addr = false;
  bool master_port = false;
  bool rdzv_id = false;
  bool rdzv_endpoint = false;
  bool standalone = false;  // --standalone: one node on its own, Slurm or not
};

// The values a step gives; each is set only when the command line left it
// open (see SlurmGiven) and the step knows it.
struct SlurmTopology {
  bool active = false;                // a task of a step, and Slurm's values are used
  std::optional<int> nnodes;          // SLURM_STEP_NUM_NODES
  std::optional<int> node_rank;       // SLURM_NODEID (relative to the step)
  std::optional<int> nproc_per_node;  // SLURM_GPUS_ON_NODE, else CUDA_VISIBLE_DEVICES, else 1
  // The first host of SLURM_STEP_NODELIST: node 0's store (static) or the
  // c10d endpoint's host.
  std::optional<std::string> master_addr;
  // slurm_port(job, step): node 0's store (static) or the c10d endpoint's port.
  std::optional<int> port;
  std::optional<std::string> rdzv_id;  // "<SLURM_JOB_ID>.<SLURM_STEP_ID>"
  // This task runs on the step's first host (SLURM_NODEID 0): under c10d with
  // the endpoint from the step, the agent that hosts the endpoint's store
  // (several node names may resolve to addresses of one machine, so the
  // address alone cannot say).
  bool first_host = false;
  // One line naming what Slurm gave and which variable gave it (for the
  // agent's log at info); empty when not active.
  std::string summary;
  // One line to log as a warning: run in a multi-node batch script outside any
  // step (only the batch host runs).
  std::string warning;
};

// Decides, from the launcher's environment, whether ctorchrun runs as a task
// of a Slurm step (SLURM_STEP_ID and SLURM_PROCID set) and what the step
// gives. Throws ConfigError (exit 2) for: --slurm=on outside a step; a step
// with more than one task on a node (SLURM_STEP_TASKS_PER_NODE, else
// SLURM_TASKS_PER_NODE, and SLURM_STEP_NUM_TASKS or SLURM_NTASKS against
// SLURM_STEP_NUM_NODES), whose message says to use --ntasks-per-node=1;
// a step variable that is not a number or a hostlist that does not expand.
SlurmTopology resolve_slurm(SlurmMode mode, const SlurmGiven& given,
                            const std::map<std::string, std::string>& env);

// The store (or c10d endpoint) port of a step: in [20000, 32000), above the
// ports of common services and below Linux's ephemeral range (32768-60999),
// so that no outgoing connection of the host takes it by chance. A hash of
// the job id plus the step id, so that steps of one job that run at once
// (numbered in sequence) never share a port.
int slurm_port(const std::string& job_id, const std::string& step_id);

// Whether Slurm's signals to a task (scancel, preemption, --signal, srun's
// Ctrl-C) reach the workers, which run in sessions of their own: false only
// under ProctrackType=proctrack/pgid, which signals the task's process group
// alone. `slurm_conf` is the text of the slurm.conf the step uses (empty:
// none readable, Slurm's default proctrack/cgroup). Pure.
bool slurm_signals_reach_workers(const std::string& slurm_conf);

// The text of the slurm.conf the step uses: $SLURM_CONF, the configless
// cache /run/slurm/conf/slurm.conf, /etc/slurm/slurm.conf; empty when none
// is readable.
std::string read_slurm_conf(const std::map<std::string, std::string>& env);

}  // namespace ctorchrun::cli
