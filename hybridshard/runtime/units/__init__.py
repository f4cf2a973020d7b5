"""Sharding units: strategies and mixed precision (``strategy``), which modules become units
(``wrap``), the pure flat layout (``layout``), storage and views (``flat_param``), CPU offload
(``offload``), changes made while gathered (``changes``), prefetch order (``prefetch``) and one
unit's states and hooks (``unit``).
"""
