"""The label convention shared by the data formats and every loss: a position whose label is
``IGNORE_INDEX`` trains nothing (no loss, no gradient, not counted in the valid tokens).

One value for the code base: torchtitan's (its cross-entropy and its trainer's token count use
it), re-exported here for components; framework/ reads torchtitan's directly.
"""

from torchtitan.components.loss import IGNORE_INDEX

__all__ = ["IGNORE_INDEX"]
