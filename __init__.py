"""k3serve: a JAX-native inference server for the Kimi K3 model family.

The repository root is this package; its folders (model/, kernels/, sharding/, server/,
proto/, checkpoints/, tools/) are the subpackages ``k3serve.model`` and so on.
"""

__version__ = "0.1.0"
