"""Prefill/decode disaggregation (issue #16): a prefill server and a decode server that smg
drives as a pair. ``bootstrap.proto`` (in ``proto/``) is the control plane, JAX's transfer
server the data plane; ``docs/pd.md`` tells the whole way of a request."""
