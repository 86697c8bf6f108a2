"""klrl.analysis."""
