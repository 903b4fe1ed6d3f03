// The MPI backend of a build without MPI: reports its absence clearly.
// (CMake compiles mpi_comm.cc instead of this file when MPI is found.)
#include <memory>

#include "ringsplash/comm.h"
#include "ringsplash/error.h"

namespace ringsplash {

bool MpiAvailable() { return false; }

std::unique_ptr<Communicator> MakeMpiCommunicator(const CommOptions& /*options*/) {
  Fail("comm backend 'mpi': this build has no MPI backend; install libopenmpi-dev and rebuild");
}

}  // namespace ringsplash
