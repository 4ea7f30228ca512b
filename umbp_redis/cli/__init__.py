"""The ``umbp-redis`` command: thin commands over the store, the router services, the
benchmarks and the demo. Not on the connector's import path."""
