"""mmvl's benchmark scripts (run them by path). A regular package so that, with the source tree first on
PYTHONPATH, ``benchmarks`` is this folder and not the top-level ``benchmarks`` package fairscale's wheel installs."""
