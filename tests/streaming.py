"""Helpers for tests that read ``LLMEngine.step()``'s streamed outputs."""

from __future__ import annotations

from paged_attention.engine.outputs import RequestOutput


def finished_only(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """The outputs of the requests that finished in this step (``step()`` also streams the others)."""
    return [o for o in outputs if o.finished]
