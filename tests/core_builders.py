"""Engine builders for cores in processes of their own (tests/test_engine_core.py): the core
process imports this module by name, so it imports nothing but the engine."""

from __future__ import annotations

from paged_attention.engine.llm_engine import LLMEngine

NUM_KV_BLOCKS = 32


def build_tiny(num_kv_blocks: int = NUM_KV_BLOCKS) -> LLMEngine:
    """The engine of tests/test_engine_core.py's cores and server (built in the core process)."""
    return LLMEngine(None, num_kv_blocks=num_kv_blocks, max_num_seqs=4)


def build_faulty(fail_at: int) -> LLMEngine:
    """An engine whose ``fail_at``-th model call raises (a bug, out of memory: a step that fails)."""
    engine = build_tiny()
    execute, calls = engine.runner.execute, [0]

    def failing(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        if calls[0] == fail_at:
            raise RuntimeError("injected: the model call failed")
        return execute(*args, **kwargs)

    engine.runner.execute = failing  # type: ignore[method-assign]
    return engine


def build_broken() -> LLMEngine:
    return LLMEngine("/nonexistent/model/folder")
