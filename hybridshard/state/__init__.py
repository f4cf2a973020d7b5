"""Everything that moves a sharded model's state in or out: full state dicts, optimizer state,
DCP checkpoints and replica checks.

- ``access``: what every state module needs from the runtime: sharded or not, idle or not, one
  unit gathered, and each parameter's range on this rank.
- ``full``: full (unsharded) model state dicts; ``optim``: optimizer state keyed by name.
- ``checkpoint``: sharded DCP checkpoints, with ``pieces`` (flat ranges as DCP chunks),
  ``progress`` (bytes written, logged), ``reader`` and ``trust`` (a checkpoint read as data, never
  as code) and ``matching`` (its sizes against the model's).
- ``replicas``: replicas of a shard still agree.
- ``pretrained_load`` / ``pretrained_save``: Hugging Face safetensors in and out; ``shapes``:
  original names and shapes for optimizers (``param_groups``, ``param_shapes``).
"""
