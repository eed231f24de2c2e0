"""`mlx-spec serve`: an OpenAI-compatible local server that speculates.

protocol.py (the wire format: validation into one `GenRequest`, bodies and errors), app.py
(Starlette routes, keys, Host / Origin), streaming.py (answering a job: SSE or one body),
prompts.py (templates rendered and tokenised off the engine thread, client text kept plain),
worker.py (the engine: the one generation thread, alone or batched), scheduler.py (the queue per
API key), resident.py (the pair, its prompt caches (prompt_cache.py) and batch), jobs.py (a
queued request and its reply), output.py
(reply text, tool calls, reasoning), stops.py (stop strings), keymetrics.py (/metrics per key),
openapi.py (/openapi.json), bounded.py and connections.py (timeouts and the connection cap).
The history index the prompt-lookup drafter also searches is `mlx_spec/decode/history.py`.
"""
