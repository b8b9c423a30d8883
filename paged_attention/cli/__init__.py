"""The command line: ``python -m paged_attention {demo, generate, walkthrough, bench, figures}``.

Argument parsing and printing only: what the commands measure is in :mod:`paged_attention.experiments`,
what they draw in :mod:`paged_attention.viz`.

main         argument parsing; generate streams one completion through LLMEngine.step()
demo         the main job: a batch of requests under a small KV budget (demo_tiny: the embedded model)
chat         a terminal chat with the real model
model        fetch and verify the real model's checkpoint
walkthrough  the allocator and page tables, step by step, as text memory maps
figures      make figures: the notebooks, then the experiments
lab          the course lab: list, build, grade
bench/       benchmarks and the paper's experiments: arguments, one call to the experiment, printing,
             and its results and figure written side by side
"""
