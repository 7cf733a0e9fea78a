"""`python -m toolkit.push`: publish a quantize run to the Hugging Face Hub, one branch per bitrate, with its model card."""

from __future__ import annotations

from dataclasses import dataclass

from .core.cli import entry, option, run
from .hub.push import PushResult, push

DESCRIPTION = ("Publish a quantize run (OUT_DIR with report.json and one folder per bitrate) to the Hugging Face Hub: "
               "each bitrate goes to its own branch, main gets the measured model card. The token comes from HF_TOKEN "
               "or `hf auth login`. Re-running finishes an interrupted push. Read the cards first: python -m toolkit.card --from OUT_DIR.")


@dataclass
class PushOptions:
    repo: str = option(help="target repo, USER/NAME (created if missing)")
    out_dir: str = option(help="the quantize OUT_DIR", flag="--from")
    private: bool = option(False, "create the repo private (ignored if it exists)")
    branch_template: str = option("{bits:.1f}bpw", "branch name per bitrate; fields {bits}, {folder}, {calibrated}")
    dry_run: bool = option(False, "list branches, files and sizes; touch nothing")
    endpoint: str | None = option(None, "Hub URL (default: HF_ENDPOINT or huggingface.co)")
    retries: int = option(4, "retries per step on 5xx or dropped connections", lo=0, hi=100)
    retry_delay: float = option(2.0, "first backoff delay in seconds, doubling", lo=0, hi=3600)


EPILOG = ("Checked before any request: --repo, --retries, --retry-delay, --endpoint, report.json (every folder it names "
          "inside --from) and that the run is complete. Writes no local files (output policy: docs/outputs.md).")


def main(argv: list[str] | None = None) -> PushResult:
    return run(push, PushOptions, argv, "python -m toolkit.push", DESCRIPTION, epilog=EPILOG)


if __name__ == "__main__":
    entry(lambda argv: main(argv) and 0)
