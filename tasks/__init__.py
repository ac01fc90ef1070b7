"""Thin Prefect tasks: each takes engine handles and small typed arguments, calls one engine method, and
returns Ray object references plus summary metrics. Tensors never pass through Prefect results."""
