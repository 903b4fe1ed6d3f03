# Cross build for 64-bit Arm Linux with Debian's cross compiler, tests run
# under qemu-user (scripts/cross_test.sh installs both):
#   cmake -S . -B build-arm64 -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake
# Libraries (GoogleTest, ...) come from Debian's multiarch packages
# (`dpkg --add-architecture arm64`, then NAME:arm64), found under
# /usr/lib/aarch64-linux-gnu through CMAKE_LIBRARY_ARCHITECTURE; header-only
# packages (CLI11, nlohmann-json) are shared with the host.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
# CTest (and gtest_discover_tests) run target binaries through this; -L points
# the emulator at the target's C library and loader.
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64 -L /usr/aarch64-linux-gnu)
