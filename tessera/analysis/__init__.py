"""Analysis of finished runs, for the tools and benchmarks (not used by training): runs side by side from
their ``metrics.jsonl`` (``run_compare``: ``tools/compare_runs.py``, the precision study) and statistics over
seeds (``seed_stats``: mean, sample standard deviation, Student's t, Welch's interval). Stdlib only."""
