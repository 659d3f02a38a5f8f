"""The GPU check (``tools/gpu_check.sh``): ``check`` (its preflight and step
summaries), ``bench`` (the benchmark it runs), ``wheels.txt`` (what it carries)."""
