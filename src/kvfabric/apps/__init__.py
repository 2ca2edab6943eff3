"""Entry points: the `kvfabric` command and what only it runs.

    cli.py        `kvfabric ...` (the bench command group comes from kvfabric.bench.commands)
    demo.py       `kvfabric demo`: cache reuse on a real model (demo_rag.py: the RAG demo)
    node.py       `kvfabric node`: a cache instance without a model, serving the synthetic workload
    statsview.py  `kvfabric stats`: an instance's counters from its /metrics

Nothing in the runtime imports this package.
"""
