"""Replay drivers, metrics, reports and plots for `everybyte bench agentic`."""
