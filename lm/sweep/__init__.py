"""Config sweeps: grids of runs trained one after another, compared in a table and a plot."""
