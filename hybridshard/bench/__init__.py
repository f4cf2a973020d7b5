"""``hybridshard bench``: hybridshard against PyTorch FSDP1, FSDP2 and a no-communication floor.

One module per concept: :mod:`.config` (what to run), :mod:`.model` (the GPT-style model and its
data), :mod:`.systems` (one trainer per contestant), :mod:`.measure` (bytes and memory of one step),
:mod:`.worker` (the timed rounds on every rank), :mod:`.stats` (medians, ratios, agreement),
:mod:`.report` and :mod:`.chart` (text, JSON and PNG), :mod:`.progress` (the bar) and :mod:`.job`
(starting the ranks on loopback or on ``launch/local-cluster``). See docs/performance.md.
"""
