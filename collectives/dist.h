#pragma once

// libctorch_dist, everything: process groups and collectives, checkpoint
// helpers, SHA-256. Link ctorchrun::dist.

#include "collectives/backend.h"
#include "collectives/checkpoint.h"
#include "collectives/process_group.h"
#include "collectives/sha256.h"
#include "collectives/types.h"
#include "collectives/work.h"
