"""Runtime: client-host actors, the coordinator actor and the round driver. Knows no particular algorithm."""
