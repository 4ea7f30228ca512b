"""Fixtures for tests, benchmarks and the demo: private Redis servers and clusters, a
slowed link, the tiny random and the real small model. Never imported by the connector."""
