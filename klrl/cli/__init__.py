"""klrl.cli.args."""
