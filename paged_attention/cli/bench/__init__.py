"""Benchmarks, run as commands (``python -m paged_attention bench <name>``), never as timed tests.

Each module parses its arguments, calls its experiment (:mod:`paged_attention.experiments`), prints
the results and writes them with their figure (:mod:`paged_attention.viz`) through ``_results``.
Each experiment measures the things it compares side by side in one run and reports ratios;
absolute times mean something only on the machine that printed them.
"""
