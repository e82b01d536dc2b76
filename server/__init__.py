"""Serving: engine, gRPC services, CLI (the engine arrives with later issues)."""
