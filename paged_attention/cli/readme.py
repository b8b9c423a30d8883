"""``python -m paged_attention readme``: README.md's result blocks, rewritten from ``figures/*.json``."""

from __future__ import annotations

from ..viz import readme as blocks
from ..viz import repo_root


def update_readme(check: bool = False) -> int:
    root = repo_root()
    if root is None:
        raise SystemExit("readme rewrites the README.md of a source checkout; none was found")
    path = root / "README.md"
    text = path.read_text()
    new = blocks.update(text)
    if new == text:
        print("README.md is up to date with figures/*.json")
        return 0
    if check:
        print("README.md is stale: run python -m paged_attention readme")
        return 1
    path.write_text(new)
    print(f"rewrote the generated blocks of {path} ({', '.join(blocks.BLOCKS)})")
    return 0
