"""Serving, above the model: ``engine/`` (the inference core: scheduler, runner, sampler,
cache), ``api/`` (the gRPC process around an engine), ``text/`` (tokenizers, chat rendering),
``client/`` (gRPC client, trace replay, trace generator), ``bench/`` (in-process benchmarks),
``cluster/`` (multi-host: the leader's plans replayed on followers) and ``cli.py`` (the
``k3serve`` command)."""
