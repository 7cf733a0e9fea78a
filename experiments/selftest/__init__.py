"""The experiments' self-check: every script imports on a CPU without exllamav3, answers --help and is listed in
experiments/README.md, and each script's own logic runs on stand-ins, so the device scripts do not rot between
device runs. It lives here, not in tests/: tests/ checks the product and never imports experiments/, so a script
can be retired (deleted; git history keeps it) without touching a test.

    python -m experiments.selftest          (CI runs it after the two test tiers; extra arguments go to pytest)
"""
