// The MPI backend of a build without MPI: reports its absence clearly.
// (CMake compiles mpi_comm.cc instead of this file when MPI is found.)
#include <memory>

#include "ringsplash/comm.h"
#include "ringsplash/error.h"

// comm_mpi.h's entry point, declared here (that header needs <mpi.h>).
namespace ringsplash::comm_detail {
std::unique_ptr<Communicator> MakeMpiCommunicatorFromHandle(const void* handle, size_t handle_bytes,
                                                            const CommOptions& options);
}  // namespace ringsplash::comm_detail

namespace ringsplash {

bool MpiAvailable() { return false; }

std::unique_ptr<Communicator> MakeMpiCommunicator(const CommOptions& /*options*/) {
  Fail("comm backend 'mpi': this build has no MPI backend; install libopenmpi-dev and rebuild");
}

namespace comm_detail {

std::unique_ptr<Communicator> MakeMpiCommunicatorFromHandle(const void* /*handle*/,
                                                            size_t /*handle_bytes*/,
                                                            const CommOptions& /*options*/) {
  Fail("comm backend 'mpi': this build has no MPI backend; install libopenmpi-dev and rebuild");
}

}  // namespace comm_detail

}  // namespace ringsplash
