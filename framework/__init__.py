"""apiary's runtime. The device shims (framework.devices) must run before torchtitan is
imported, because torchtitan reads the device type when it is imported. Importing this package
does not import torch (the command-line tools start in well under a second): it puts a finder
on ``sys.meta_path`` that applies the shims the moment anything first imports torchtitan."""

from __future__ import annotations

import sys


class _ShimsBeforeTorchtitan:
    """A meta-path finder that finds nothing: on the first import of torchtitan (or any of its
    submodules) it removes itself and runs ``framework.devices.install()``, then lets the
    ordinary finders import torchtitan."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "torchtitan":
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            from framework import devices  # reason: start-up time (imports torch); the shims, before torchtitan

            devices.install()
        return None


if not any(isinstance(f, _ShimsBeforeTorchtitan) for f in sys.meta_path) and "torchtitan" not in sys.modules:
    sys.meta_path.insert(0, _ShimsBeforeTorchtitan())
elif "torchtitan" in sys.modules:  # too late for the finder: install() says so, as before
    from framework import devices as _devices

    _devices.install()
