"""Benchmarks, run as commands (``python -m paged_attention bench <name>``), never as timed tests.

Each one measures the things it compares side by side in one run and reports ratios; absolute
times mean something only on the machine that printed them.
"""
