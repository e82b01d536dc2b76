"""Checkpoints: Hugging Face safetensors I/O (MXFP4 experts), synthetic K3 checkpoints,
pre-shards, and ``load_pretrained`` (a checkpoint or pre-shard into a ``KimiModel``)."""


def __getattr__(name):
    if name == "load_pretrained":  # lazily: ``import k3serve.checkpoints.safetensors_io`` stays free of jax
        from .loader import load_pretrained

        return load_pretrained
    raise AttributeError(name)
