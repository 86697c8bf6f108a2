"""klrl.step."""
