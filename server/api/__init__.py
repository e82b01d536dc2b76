"""The serving process around an engine: the engine thread, the gRPC services (SGLang
scheduler protocol, health, reflection), API-key auth, Prometheus metrics, ``k3serve serve``."""
