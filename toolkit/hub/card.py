"""Model cards from a quantize report: the main-branch card (every bitrate) and the per-bitrate README.

`render_card(report)` is the one entry point. Numbers come only from report.json; a null there is printed
as "not measured", never guessed. Metadata goes through huggingface_hub's ModelCardData.
"""

from __future__ import annotations

from huggingface_hub import ModelCard, ModelCardData

from ..core.errors import ToolkitError

HUB = "https://huggingface.co"
TAGS = ["exl3", "dflash", "speculative-decoding"]
NOT_MEASURED = "not measured"
COLUMNS = ["Branch", "Bits", "Size", "Calibrated", "KL vs bf16", "Top-1 agreement", "τ (tokens/round)", "Validation"]


def human_size(n: int | None) -> str:
    if n is None:
        return NOT_MEASURED
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def _num(value, fmt: str) -> str:
    return NOT_MEASURED if value is None else format(value, fmt)


def _pct(value) -> str:
    return NOT_MEASURED if value is None else f"{100 * value:.1f}%"


def _check(passed) -> str:
    return NOT_MEASURED if passed is None else ("pass" if passed else "FAIL")


def pick_pushed(results: list[dict]) -> list[dict]:
    """The rows that get a branch: `pushed` not false, and a calibrated row wins over an uncalibrated twin."""
    rows = [r for r in results if r.get("pushed", True) is not False]
    cal_bits = {float(r["bits"]) for r in rows if r.get("calibrated")}
    return [r for r in rows if r.get("calibrated") or float(r["bits"]) not in cal_bits]


def check_report(report: dict) -> None:
    """Raise ToolkitError when report.json is not the version-1 schema this module renders."""
    if report.get("schema") != 1:
        raise ToolkitError(f"report.json: schema must be 1, got {report.get('schema')!r}")
    for key in ("model", "results"):
        if not report.get(key):
            raise ToolkitError(f"report.json: field {key!r} is missing or empty")
    for i, r in enumerate(report["results"]):
        missing = [k for k in ("bits", "folder", "size_bytes", "calibrated") if k not in r]
        if missing:
            raise ToolkitError(f"report.json: results[{i}] lacks {', '.join(missing)}")


def card_data(report: dict) -> ModelCardData:
    return ModelCardData(
        base_model=report["model"],
        base_model_relation="quantized",
        library_name="exllamav3",
        pipeline_tag="text-generation",
        tags=list(TAGS),
    )


def _name(report: dict) -> str:
    return report["model"].split("/")[-1]


def _branch_cell(row: dict, branches: dict[str, str], repo: str | None) -> str:
    branch = branches.get(row["folder"])
    if branch is None:
        return f"{row['folder']} (not uploaded)"
    return f"[{branch}]({HUB}/{repo}/tree/{branch})" if repo else branch


def table(report: dict, branches: dict[str, str], repo: str | None, bits: float | None = None) -> list[str]:
    """The measured table: one row per result (all of them, uploaded or not), then the bf16 reference."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in report["results"]:
        if bits is not None and float(r["bits"]) != float(bits):
            continue
        cells = [_branch_cell(r, branches, repo), f"{float(r['bits']):.2f}", human_size(r["size_bytes"]),
                 "yes" if r["calibrated"] else "no", _num(r.get("kl"), ".4g"), _pct(r.get("top1")),
                 _num(r.get("tau"), ".2f"), _check(r.get("passed"))]
        lines.append("| " + " | ".join(cells) + " |")
    bf16 = report.get("bf16") or {}
    ref = [f"[bf16 original]({HUB}/{report['model']})", "16.00", human_size(bf16.get("size_bytes")), "n/a",
           "0 (reference)", "100% (reference)", _num(bf16.get("tau"), ".2f"), "n/a"]
    lines.append("| " + " | ".join(ref) + " |")
    return lines


def _about(report: dict) -> list[str]:
    model, target = report["model"], report.get("target")
    rev = f" at revision `{report['revision']}`" if report.get("revision") else ""
    target_txt = f" for [{target}]({HUB}/{target})" if target else ""
    return [
        f"EXL3 quantizations of the DFlash block-diffusion drafter [{model}]({HUB}/{model}){rev}{target_txt}.",
        "A DFlash drafter proposes a whole block of tokens per round from the target's hidden states; the target "
        "verifies them, so output is exactly the target's: a smaller drafter only changes speed.",
        "",
        f"Made with dflash-exl3-toolkit {report.get('toolkit_version', '?')} and exllamav3 "
        f"{report.get('exllamav3_version', '?')} on {report.get('created', '?')}; block size "
        f"{report.get('block_size', '?')}, tap shift {report.get('tap_shift', '?')}.",
    ]


def _method(report: dict) -> list[str]:
    device = report.get("device")
    where = f"measured on {device}" if device else "not measured in this run (it needs a GPU)"
    return [
        "KL is the mean KL divergence of each quantized drafter's next-token distribution from the bf16 "
        "drafter's, and top-1 agreement the share of positions where both pick the same token, over the "
        "block positions of the calibration prompts. τ is the mean number of tokens accepted per "
        f"verification round with the target, {where}. \"not measured\" means the run skipped that "
        "measurement; no number is estimated.",
    ]


def _usage(report: dict, repo: str | None, branch: str) -> list[str]:
    repo = repo or "USER/REPO"
    local = f"{_name(report)}-exl3-{branch}"
    target = report.get("target") or "the target model"
    return [
        "```sh",
        f"hf download {repo} --revision {branch} --local-dir {local}",
        "```",
        "",
        "### With exllamav3",
        "",
        f"The drafter runs next to an EXL3 quant of {target} (the target; its folder is `TARGET` below):",
        "",
        "```python",
        "from exllamav3 import Cache, Config, Generator, Model, Tokenizer",
        "",
        f"config, draft_config = Config.from_directory(\"TARGET\"), Config.from_directory(\"{local}\")",
        "model, draft = Model.from_config(config), Model.from_config(draft_config)",
        f"block = draft.caps.get(\"default_draft_size\", {report.get('block_size') or 16})",
        "cache = Cache(model, max_num_tokens=32768, max_history=block)  # caches before load()",
        "draft_cache = Cache(draft, max_num_tokens=32768, max_history=block)",
        "draft.load()",
        "model.load()",
        "generator = Generator(model=model, cache=cache, tokenizer=Tokenizer.from_config(config),",
        "                      draft_model=draft, draft_cache=draft_cache)",
        "print(generator.generate(prompt=\"Hello\", max_new_tokens=200))",
        "```",
        "",
        "### With dflash-exl3-toolkit",
        "",
        "```sh",
        f"python -m toolkit.generate --backend exllamav3 --target TARGET --draft {local} "
        "--prompt \"Hello\" --compare-ar",
        f"python app.py --backend exllamav3 --target TARGET --draft {local}   # the chat app",
        "```",
    ]


def render_card(report: dict, repo: str | None = None, bits: float | None = None, *,
                branches: dict[str, str] | None = None, image: str | None = None) -> str:
    """README.md text (YAML front matter + body) for the main branch, or for one bitrate's branch when `bits`.

    `branches` maps result folder -> Hub branch for the rows that are uploaded; by default the report's own
    `branch` of every pushed row. `image` is a file next to the card (tau_top1.png) to embed.
    """
    check_report(report)
    if branches is None:
        branches = {r["folder"]: r.get("branch") or f"{float(r['bits']):.1f}bpw" for r in pick_pushed(report["results"])}
    if bits is not None and not any(float(r["bits"]) == float(bits) for r in report["results"]):
        have = ", ".join(f"{float(r['bits']):.1f}" for r in report["results"])
        raise ToolkitError(f"render_card: bits={bits} is not in report results (have {have})")
    title = f"# {_name(report)} EXL3" + (f" {float(bits):.1f} bpw" if bits is not None else "")
    body = [title, "", *_about(report), ""]
    if bits is not None:
        main = f"[the main branch]({HUB}/{repo})" if repo else "the main branch"
        body += [f"This branch holds the {float(bits):.1f} bits-per-weight quant; {main} lists every bitrate.", ""]
    body += ["## Measured quality", "", *table(report, branches, repo, bits), ""]
    if image and bits is None:
        body += [f"![τ and top-1 agreement per block position]({image})", ""]
    body += [*_method(report), "", "## Download", ""]
    shown = [(f, b) for f, b in branches.items()
             if bits is None or any(r["folder"] == f and float(r["bits"]) == float(bits) for r in report["results"])]
    if not shown:
        body += ["No branch of this report was uploaded.", ""]
    for _, branch in shown:
        body.append(f"- `{branch}`: `hf download {repo or 'USER/REPO'} --revision {branch}`")
    body += ["", "## How to run", ""]
    body += _usage(report, repo, shown[0][1] if shown else "4.0bpw")
    content = f"---\n{card_data(report).to_yaml()}\n---\n\n" + "\n".join(body) + "\n"
    return str(ModelCard(content))
