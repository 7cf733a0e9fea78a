"""Errors, files and the command-line plumbing every other part of the toolkit builds on."""
