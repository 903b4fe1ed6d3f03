"""pytest setup for the Python package's tests.

XLA reads XLA_FLAGS once, when JAX first starts its CPU backend, so the host
device count the shard_map ring tests need (up to 8) is set here, before any
test module imports JAX. A user's own value is kept if it already asks for
host devices.
"""

import os

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_FLAG}=8").strip()
