"""`tiered-cache bench serve`: the same open-loop workload through each way of serving on Ray (Ray
Serve LLM's routers with and without our connector, our router, our HF workers), TTFT and
throughput side by side, the greedy answers compared."""
