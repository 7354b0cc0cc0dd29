"""``python -m toolkit.compare ARGS``: ``apiary compare ARGS``."""

import sys

from toolkit.compare import compare_main

sys.exit(compare_main())
