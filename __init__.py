"""k3serve: a JAX-native inference server for the Kimi K3 model family.

The repository root is this package: its folders model/, kernels/, sharding/, checkpoints/ and
server/ are the subpackages ``k3serve.model`` and so on (tests/ and tools/ are not shipped).

``from k3serve import LLM, SamplingParams`` is the offline engine API (imported lazily, so
``import k3serve`` stays cheap).
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "Engine"]


def __getattr__(name):
    if name == "LLM":
        from .server.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from .server.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "Engine":
        from .server.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'k3serve' has no attribute {name!r}")
