"""The vLLM backend: the trainer-side client (client.py), the worker process it starts
(process.py) and the worker script that runs in vLLM's own environment (worker.py)."""
