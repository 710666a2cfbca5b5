"""The benchmarks of hf_gpa: step time, memory, throughput and the paper's comparison at small scale.

Each benchmark is a module run from the repository root, ``python -m benchmarks.NAME --help``; it prints a table and
writes it with its raw numbers (and, where there is one, a plot) under ``benchmarks/results/`` or ``--out``. What
several of them share lives in two modules: ``workloads`` (the models, parameter lists, corpus and least-squares
problem they run on, and every optimizer built through the ``--optim`` table) and ``report`` (interleaved timing
rounds, state bytes, tables, plots, JSON records); ``ranks`` runs a benchmark on several CPU processes whose every
collective is counted and, on request, slowed down as if it crossed a slow link. A benchmark is never a test; the
tests run each one at a tiny size.
"""
