"""What a run shows: metrics to every sink (`tracking`), health alarms, the summary and resolved config, plots, the live display, metric names."""
