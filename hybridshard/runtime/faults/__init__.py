"""Ranks that fail: asking the others where they are (``peers``), errors that name the lost rank
(``errors``), the hang watchdog (``watchdog``) and how a rank exits (``exits``).
"""
