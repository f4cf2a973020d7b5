"""Planning a job before it runs: memory and step-time estimates per strategy (``sizing``) and their
text and JSON forms (``format``); ``hybridshard plan`` is the command over them."""
