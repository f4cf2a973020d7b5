"""Issuing collectives: ``collectives`` (stateless, group passed explicitly), the debug and step checks
(``agreement``), tensors handed to a backend (``handoff``); ``executors/`` decides who issues them.
"""
