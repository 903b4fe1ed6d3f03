// Umbrella header: everything a user of ringsplash needs.
#ifndef RINGSPLASH_RINGSPLASH_H_
#define RINGSPLASH_RINGSPLASH_H_

#include "ringsplash/attention.h"
#include "ringsplash/comm.h"
#include "ringsplash/context_parallel.h"
#include "ringsplash/error.h"
#include "ringsplash/mask.h"
#include "ringsplash/ring.h"
#include "ringsplash/tensor.h"

#endif  // RINGSPLASH_RINGSPLASH_H_
