"""``python -m paged_attention ...``: the command line lives in :mod:`paged_attention.cli`."""

from .cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
