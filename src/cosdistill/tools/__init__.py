"""The command line's tools: ``bench`` (the benchmark harness and its ledger), ``check`` (the correctness
sweep), ``demo`` (a small distillation run), and ``cli`` (``cosdistill bench|check|demo``)."""
