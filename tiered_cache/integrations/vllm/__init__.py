"""tiered-cache as a vLLM KV connector (`TieredCacheConnector`). Importing this package is free;
`connector.py` imports vLLM."""
