"""`halo-master serve`: an OpenAI-compatible HTTP API, a chat page and a live cluster view over one cluster.

- engine.py: the one thread that owns the model (a single-process Transformer or a cluster master)
  and runs one generation at a time from a bounded queue; cancellation, timeouts, rebuilds after an
  agent failure, and the cluster snapshots everything else reads.
- protocol.py: OpenAI request validation and the response / stream-chunk shapes.
- app.py: the FastAPI application (routes, API key, server-sent events, static pages).
- view.py: the cluster view as data (web page, JSON) and as a rich table (`halo-master status --watch`).
- metrics.py: the Prometheus exposition (`GET /metrics`).
- static/: the chat page and cluster view (plain HTML/JS/CSS, no CDN).

Only view.py is imported without the `serve` extra (the terminal view needs rich alone).
"""
