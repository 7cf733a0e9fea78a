"""`python -m toolkit.push`: publish a quantize run to the Hugging Face Hub, one branch per bitrate, with its model card."""

from __future__ import annotations

from .core.cli import entry, run
from .hub.push import PushOptions, PushResult, push

DESCRIPTION = ("Publish a quantize run (OUT_DIR with report.json and one folder per bitrate) to the Hugging Face Hub: "
               "each bitrate goes to its own branch, main gets the measured model card. The token comes from HF_TOKEN "
               "or `hf auth login`. Re-running finishes an interrupted push. Read the cards first: python -m toolkit.card --from OUT_DIR.")

EPILOG = ("Checked before any request: --repo, --retries, --retry-delay, --endpoint, report.json (every folder it names "
          "inside --from) and that the run is complete. Writes no local files (output policy: docs/outputs.md).")


def main(argv: list[str] | None = None) -> PushResult:
    return run(lambda **kw: push(PushOptions(**kw)), PushOptions, argv, "python -m toolkit.push", DESCRIPTION,
               epilog=EPILOG)


if __name__ == "__main__":
    entry(lambda argv: main(argv) and 0)
