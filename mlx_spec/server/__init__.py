"""`mlx-spec serve`: an OpenAI-compatible local server that speculates.

protocol.py (the wire format), stops.py (stop strings), worker.py (the queue, the one
generation thread, caches kept across requests), app.py (Starlette routes). The history index
the prompt-lookup drafter also searches is `mlx_spec/decode/history.py`.
"""
