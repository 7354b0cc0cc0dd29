"""Launch-side process machinery: the torchrun supervisor (lifecycle.py: signals in, exit codes out)
and the run directory's lock (runlock.py)."""
