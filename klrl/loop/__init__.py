"""klrl.loop.driver."""
