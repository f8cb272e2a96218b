"""What runs and reads experiments, above the engine: suites and sweeps of runs
(``contrafl experiment``, ``compare``, ``sweep``), their tables and reports (text,
Markdown, HTML, figures), and the representation probes and plots of finished runs
(``eval-repr``, ``plot-repr``). What the round loop itself measures is
:mod:`contrafl.metrics`, below the engine."""
