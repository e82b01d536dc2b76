"""Multi-host serving: one engine over a mesh that spans processes (``jax.distributed``).

Process 0, the leader, serves gRPC and schedules; every device call its engine makes is
also sent, by name with its host arguments, to the followers, which run it on identical
engines (``runtime.py`` joins the cluster, ``wire.py`` frames the messages, ``leader.py``
sends and watches, ``follower.py`` runs). Tensors never cross this channel: the step's
collectives are XLA's. See docs/multihost.md."""
