"""Observability: what every process counts and exports.

    counters.py  thread-safe named counters (every component's)
    metrics.py   the METRICS table, Histograms, the scrape-time collector, the /metrics endpoint
    events.py    KV events: chunks stored and removed, published on ZMQ in vLLM's wire format
"""
