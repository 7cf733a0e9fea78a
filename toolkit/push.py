"""`python -m toolkit.push`: publish a quantize run to the Hugging Face Hub, one branch per bitrate, with its model card."""

from __future__ import annotations

import argparse

from .core.errors import run_cli
from .hub.push import PushResult, push


def main(argv: list[str] | None = None) -> PushResult:
    p = argparse.ArgumentParser(
        prog="python -m toolkit.push",
        description="Publish a quantize run (OUT_DIR with report.json and one folder per bitrate) to the "
        "Hugging Face Hub: each bitrate goes to its own branch, main gets the measured model card. "
        "The token comes from HF_TOKEN or `hf auth login`. Re-running finishes an interrupted push.")
    p.add_argument("--repo", required=True, help="target repo, USER/NAME (created if missing)")
    p.add_argument("--from", dest="out_dir", required=True, help="the quantize OUT_DIR")
    p.add_argument("--private", action="store_true", help="create the repo private (ignored if it exists)")
    p.add_argument("--branch-template", default="{bits:.1f}bpw",
                   help="branch name per bitrate; fields {bits}, {folder}, {calibrated} (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="list branches, files and sizes; touch nothing")
    p.add_argument("--endpoint", default=None, help="Hub URL (default: HF_ENDPOINT or huggingface.co)")
    p.add_argument("--retries", type=int, default=4, help="retries per step on 5xx or dropped connections")
    p.add_argument("--retry-delay", type=float, default=2.0, help="first backoff delay in seconds, doubling")
    args = p.parse_args(argv)
    return push(**vars(args))


if __name__ == "__main__":
    run_cli(lambda: main() and 0)
