"""The drafting policy: each round's verify width from a cost model and hindsight acceptance (chooser.py)."""
