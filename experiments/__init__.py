"""Device experiments: the scripts that measured what docs/benchmarks.md, docs/performance.md and the
docs/*.json records report, run as `python -m experiments.<name>` from the repository root (README.md lists
them). Not shipped with the package; they share experiments.harness and import toolkit like any user would.
"""
