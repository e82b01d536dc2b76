"""In-process benchmarks behind ``k3serve bench offline`` and ``k3serve bench prefix``."""
