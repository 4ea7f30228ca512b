"""The demo: a cold and a warm vLLM engine sharing one Redis on this machine's CPU."""
