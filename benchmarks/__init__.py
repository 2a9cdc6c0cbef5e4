"""Speed measurements of pipeshard: `python -m benchmarks` (= `pipeshard bench`) runs the paper's
experiments side by side in one run; the other modules are the single-purpose scripts it reuses.
"""
