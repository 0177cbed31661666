"""Benchmarks: each module measures one thing and prints its figures (`--json PATH` writes them).

Run them as modules from the repository root, e.g. `python -m bench.pipeline --json
runs/bench-pipeline.json`; each module's docstring says what it measures and how to run it.
"""
