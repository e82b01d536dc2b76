"""Clients of a running server: the gRPC client, the trace replayer behind ``k3serve bench``,
and the agentic trace generator (``python -m k3serve.server.client.traces``)."""
