"""Use hybridshard from the trainers people already run.

- :mod:`hybridshard.integrations.hf`: :class:`HybridShardTrainer`, a Hugging Face ``Trainer`` (on
  ``accelerate``) that trains a hybridshard model (``pip install hybridshard[hf]``).
- :mod:`hybridshard.integrations.lightning`: :class:`HybridShardStrategy` for Lightning's ``Trainer``,
  also selectable as ``strategy="hybridshard"`` (``pip install hybridshard[lightning]``).
- :mod:`hybridshard.integrations.fabric`: :class:`HybridShardFabricStrategy` for Lightning Fabric, the
  same names in Fabric's registry (``pip install hybridshard[lightning]``).

Each module imports its trainer library when it is imported, and raises an ``ImportError`` naming
the extra to install when the library is missing. :mod:`hybridshard.integrations.common` holds what
both share.
"""
