"""One module per ``hybridshard`` subcommand."""
