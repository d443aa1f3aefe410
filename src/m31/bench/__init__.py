"""`m31 bench`: the score·filter·top-K pass against every baseline measured in the same run,
every kernel against the reference, and the engine end to end (DESIGN §5, §6).

    cli.py        the command (`m31 bench`, `python -m m31.bench`) and `main(argv)`
    suite.py      run_suite: the sections one run asks for, written to the output folder
    cases.py      what a timing run measures: VARIANTS, the canonical shapes (no torch)
    common.py     device limits, timing, memory, the random problem, recall@K
    baselines.py  eager and compiled §2 chunks, chunked top-K, two-tower, FAISS
    kernels.py    run_timings: every variant per shape, % of the device limit
    check.py      run_check: kernels vs the reference, judged by m31.ops.testing.check_topk
    engine.py     run_engine: Retriever.retrieve over a synthetic index of N ads
    report.py     markdown, CSV, ratios, GPU acceptance, the plot

Nothing is imported here: `m31.cli` imports `m31.bench.cli`, which must not pull in PyTorch.
"""
