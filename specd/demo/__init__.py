"""`specd demo`: the controller and two decode workers (adaptive and no speculation) on the reference pair,
driven with the segment workloads side by side, with a live table, a summary, traces and a plot."""
