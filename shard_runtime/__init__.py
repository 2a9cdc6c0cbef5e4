"""The OpenVINO runtime of a shard, shared by every process that runs one: the stage
(``stage_node``), the gateway's draft model (``server``) and the exporter's checks.

- :mod:`shard_runtime.runner` - a compiled stateful shard, one infer request per session;
- :mod:`shard_runtime.paged` - a paged shard: batched calls over a pool of KV blocks;
- :mod:`shard_runtime.chain` - every stage of an export chained in one process;
- :mod:`shard_runtime.sampling` and :mod:`shard_runtime.speculative` - sampling and draft
  verification from logits rows (numpy only).
"""
