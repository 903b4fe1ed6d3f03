// The MPI backend on a communicator the application made: for programs that
// use MPI themselves. Includes <mpi.h>; comm.h does not, so programs that do
// not use MPI never need it. Link the program with MPI as usual (CMake:
// MPI::MPI_CXX); ringsplash must have been built with the same MPI.
//
//   MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
//   MPI_Comm cp;  // this rank's context-parallel group
//   MPI_Comm_split(MPI_COMM_WORLD, world_rank / cp_size, world_rank, &cp);
//   auto comm = ringsplash::MakeMpiCommunicator(cp, ringsplash::CommOptions{});
//   ringsplash::RingAttentionForward(*comm, ...);  // a ring over `cp` only
#ifndef RINGSPLASH_COMM_MPI_H_
#define RINGSPLASH_COMM_MPI_H_

#include <mpi.h>

#include <cstddef>
#include <memory>

#include "ringsplash/comm.h"

namespace ringsplash {

namespace comm_detail {
// What MakeMpiCommunicator(MPI_Comm, ...) calls: the handle's bytes, so that
// the library itself (and its build without MPI) needs no MPI types in its
// interface. Not for direct use.
std::unique_ptr<Communicator> MakeMpiCommunicatorFromHandle(const void* handle, size_t handle_bytes,
                                                            const CommOptions& options);
}  // namespace comm_detail

// The MPI backend over the ranks of `comm`, an intra-communicator of the
// application: rank() and size() are those of `comm`. Collective over `comm`
// (every rank of it calls this, in the same order as its other collectives
// on `comm`). ringsplash duplicates `comm` (MPI_Comm_dup), so its messages
// never match the application's own on `comm`, nor those of any other
// communicator; the application keeps `comm` and may free it at once.
// Everything comm.h says of the MPI backend holds: an application that
// initialised MPI must have asked for MPI_THREAD_MULTIPLE (else Error; MPI
// is initialised here if it was not); failures are final for the job and
// are reported with MPI_COMM_WORLD ranks; DefaultThreads() counts the
// processes on the machine, not the ranks of `comm`; and the first
// communicator a process makes starts the backend, collectively over
// MPI_COMM_WORLD, so every process of the job calls this (or comm.h's
// MakeMpiCommunicator) at least once. A process MPI_Comm_split left out of
// every group passes the MPI_COMM_NULL it got: it takes part in that start,
// then gets an Error (it has no group). An inter-communicator is an Error
// too, and so is any call in a build without the MPI backend.
inline std::unique_ptr<Communicator> MakeMpiCommunicator(MPI_Comm comm,
                                                         const CommOptions& options) {
  return comm_detail::MakeMpiCommunicatorFromHandle(&comm, sizeof(comm), options);
}

}  // namespace ringsplash

#endif  // RINGSPLASH_COMM_MPI_H_
