"""A unit's gradient after backward: what is reduced in which group (``reduce``) and the compressed
replicate all-reduce (``compression``).
"""
