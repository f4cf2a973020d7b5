"""Records of what this rank does, read by every layer above: where it is (``position``), what it
issued (``counters``, ``issue_order``) and what made the host wait (``host_syncs``). No communication.
"""
