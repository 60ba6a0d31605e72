"""Command-line interface: ``hf-tp SUBCOMMAND``."""
