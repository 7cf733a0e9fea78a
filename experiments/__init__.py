"""Device experiments: the measurement scripts behind the results page, run as `python -m experiments.<name>` from
the repository root (README.md lists them). Not shipped with the package; they share experiments.harness and
import toolkit like any user would.
"""
