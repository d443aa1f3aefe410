"""`m31 bench <what>`: every benchmark of the project. The score·filter·top-K pass against every
baseline measured in the same run, every kernel against the reference, and the engine end to
end (DESIGN §5, §6); then the index's parts, the trained model's tables, the cluster and events.
bench/RESULTS.md's first table lists them with where their figures are.

    cli.py        the commands (`m31 bench <what>`, `python -m m31.bench <what>`), `main(argv)`
    suite.py      run_suite: what `kernels` or `engine` asks for, written to the output folder
    cases.py      what a timing run measures: VARIANTS, the canonical shapes (no torch)
    common.py     device limits, timing, memory, the random problem, recall@K
    baselines.py  eager and compiled §2 chunks, chunked top-K, two-tower, FAISS
    kernels.py    run_timings: every variant per shape, % of the device limit
    check.py      run_check: kernels vs the reference, judged by m31.ops.testing.check_topk
    engine.py     run_engine: Retriever.retrieve over a synthetic index of N ads
    report.py     markdown, CSV, ratios, GPU acceptance, the plot
    results.py    the results table (bench/results.csv): every run's figures, a row each

The other subcommands, a module each, printing their tables (`run`):

    eligibility.py       masks per request: row bitmaps against the column builder
    attribute_memory.py  memory per distinct list value, the cost of a targeting mask
    embedding_cache.py   the text-embedding cache per upsert
    table_dtypes.py      the engine's results over bf16 and int8 tables against float32
    hierarchical.py      recall and speed-up of probing clusters (`m31.engine.probe`)
    cluster.py           scatter-gather overhead on Ray against the single process
    events.py            events beside retrieves in one process
    loadtest.py          `m31 loadtest`: closed-loop load on a running server, over HTTP

Each `run` returns its figures (`results.Figure`; loadtest's rows become figures through
`figures`), which the command appends to the results table.
Nothing is imported here: `m31.cli` imports `m31.bench.cli`, which must not pull in PyTorch.
"""
