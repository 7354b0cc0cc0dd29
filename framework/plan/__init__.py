"""Planning before launch: the memory and step-time estimate (planner/) and the preflight that holds a
resolved run against the GPU (preflight.py)."""
