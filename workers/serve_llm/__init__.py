"""Serving through Ray Serve LLM (`cluster start --engine vllm`): vLLM replicas with our connector
in each engine, the cluster's store shards below them, an OpenAI front end that keeps our
promises (loopback, a token beyond it) and our request router choosing among the replicas."""
