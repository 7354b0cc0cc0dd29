"""Resolution, before any worker starts: the composed config checked (one file per reason), the model's
facts, the derived layout (layout.py), what a resume may change (resume.py), and the hand-off of the
resolved run to the ranks (handoff.py). The entry point is framework/resolve/resolver.py."""
