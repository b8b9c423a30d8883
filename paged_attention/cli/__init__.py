"""The command line: ``python -m paged_attention {demo, generate, walkthrough, bench, figures}``.

main         argument parsing; generate streams one completion through LLMEngine.step()
demo         the main job: a batch of requests under a small KV budget
walkthrough  the allocator and page tables, step by step, as text memory maps
figures      make figures: the notebooks, then the experiments
bench/       benchmarks and the paper's experiments, each measured side by side
"""
