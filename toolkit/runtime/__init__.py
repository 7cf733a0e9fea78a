"""Decoding: the Backend interface and its torch and exllamav3 engines, the speculative loop, Round events.

Consumers build a backend with `runtime.factory.load_backend` and call the `runtime.backend.Backend` members.
"""
