"""The Redis data plane: settings and URL parsing, RESP framing, connections, lookups,
stores and loads, and the stored value format. No vLLM, no torch.
"""
