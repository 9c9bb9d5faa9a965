"""What a run leaves to read afterwards: its metrics log, and figures drawn from it."""
