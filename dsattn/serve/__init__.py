"""Serving many requests at once over one fixed batch of cache rows (continuous batching):
request.py (what a client asks and what it gets back), pool.py (the host's page accounting
and pool sizing), programs.py (the compiled per-row sampling and row clearing),
scheduler.py (admission, chunked prefill, decode, retirement, preemption) and app.py (the
OpenAI-compatible HTTP server of scripts/serve.py)."""
