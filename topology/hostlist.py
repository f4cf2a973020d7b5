"""Slurm host lists: ``gpu[07-09,12]``, ``a[1-2],b3``, ``rack[1-2]-n[01-02]`` expanded into names.

One parser for the launcher (``SLURM_JOB_NODELIST``) and for discovery (the ``Nodes=`` and
``Switches=`` of a Slurm ``topology.conf``, see :mod:`hybridshard.topology.topofile`); it needs no
Slurm tools.
"""

from __future__ import annotations

import re

__all__ = ["parse_nodelist"]

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets; raise on unbalanced brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"node list {text!r}: nested '[' at position {i}; expected e.g. 'gpu[01-04]'")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"node list {text!r}: ']' without '[' at position {i}")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"node list {text!r}: '[' is never closed; expected e.g. 'gpu[01-04]'")
    items.append(text[start:])
    return items


def _expand_ranges(body: str, whole: str) -> list[str]:
    """``"07-09,12"`` -> ``["07", "08", "09", "12"]``, keeping the zero padding of each range."""
    out = []
    for part in body.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise ValueError(f"node list {whole!r}: bad range {part!r} inside brackets; expected N or N-M, e.g. '[01-04,07]'")
        lo_text, hi_text = m.group(1), m.group(2)
        lo, hi = int(lo_text), int(hi_text if hi_text is not None else lo_text)
        if hi < lo:
            raise ValueError(f"node list {whole!r}: range {part!r} runs backwards; write it as {hi_text}-{lo_text}")
        width = len(lo_text)
        out += [str(n).zfill(width) for n in range(lo, hi + 1)]
    return out


def _expand_item(item: str, whole: str) -> list[str]:
    """One comma-free item, possibly with several bracket groups: their cartesian product."""
    names = [""]
    for m in re.finditer(r"([^\[]*)(?:\[([^\]]*)\])?", item):
        literal, body = m.group(1), m.group(2)
        if not literal and body is None:
            continue
        names = [n + literal for n in names]
        if body is not None:
            names = [n + suffix for n in names for suffix in _expand_ranges(body, whole)]
    return names


def parse_nodelist(nodelist: str) -> tuple[str, ...]:
    """Expand a Slurm host list in the order Slurm gives it.

    >>> parse_nodelist("gpu[07-09,12]")
    ('gpu07', 'gpu08', 'gpu09', 'gpu12')
    >>> parse_nodelist("a[1-2],b3")
    ('a1', 'a2', 'b3')
    """
    text = nodelist.strip()
    if not text:
        raise ValueError("node list is empty; expected SLURM_JOB_NODELIST like 'gpu[01-04]'")
    hosts: list[str] = []
    for item in _split_top_level(text):
        item = item.strip()
        if not item:
            raise ValueError(f"node list {nodelist!r} has an empty entry (two commas in a row or a trailing comma)")
        hosts += _expand_item(item, nodelist)
    return tuple(hosts)
