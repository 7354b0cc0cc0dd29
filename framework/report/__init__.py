"""What a run reports: metrics.jsonl (metrics.py), the console while training (progress.py) and the
end-of-run summary (summary.py)."""
