"""The inference core, with no gRPC and no tokenizer: ``Engine`` (continuous batching over a
device cache), ``Scheduler``, ``Runner`` (shapes, launch, warm-up), the batched sampler,
requests and ``SamplingParams``, the offline ``LLM`` API, and ``cache/``."""
