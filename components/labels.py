"""The label convention shared by the data formats and every loss: a position whose label is
``IGNORE_INDEX`` trains nothing (no loss, no gradient, not counted in the valid tokens).

One value for the code base: torchtitan's (its cross-entropy and its trainer's token count use
it), written out here so that importing a component does not import torchtitan (the command-line
tools' start-up time); tests/test_startup.py holds it equal to
``torchtitan.components.loss.IGNORE_INDEX``. framework/ reads torchtitan's directly.
"""

IGNORE_INDEX = -100

__all__ = ["IGNORE_INDEX"]
