"""KV events in vLLM's format (`schema.py`) and their ZMQ publisher (`publisher.py`): where every
page is, told to routers (Dynamo's KV router, llm-d's prefix scorer, ours) that read vLLM's events.
Importing this package is free; the publisher imports pyzmq and msgpack (the `events` extra)."""
