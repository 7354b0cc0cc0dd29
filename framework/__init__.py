"""apiary's runtime. Importing it applies the device shims (framework.devices) first,
because torchtitan reads the device type when it is imported."""

from framework import devices as _devices

_devices.install()
