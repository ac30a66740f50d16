"""plan: from a model and a cluster to the fastest layouts that fit (python -m titanlite.plan).

devices.py holds the GPUs' figures, perf.py the step-time model (its docstring is the model),
search.py the layouts and their checks, calibrate.py the fit to real runs, report.py the output.
"""
