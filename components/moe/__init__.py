"""MoE components: dispatch/combine backends (moe_comm) and overlap schedules (moe_chunk)."""

from components.moe import gloo_alltoall as _gloo_alltoall
from framework import devices as _devices

_devices.on_cpu_parallelize(_gloo_alltoall.install)  # CPU runs: EP all-to-all through gloo
