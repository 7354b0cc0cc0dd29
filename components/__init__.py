"""apiary's primitives. Device shims come first (see framework.devices)."""

import framework  # noqa: F401  (applies device shims before torchtitan is imported)
