"""klrl.algo."""
