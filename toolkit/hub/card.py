"""Model cards from a quantize report: the main-branch card (every bitrate) and the per-bitrate README.

`render_card(report, upstream=OUT/upstream)` is the one entry point; `run_card(OUT)` renders what push uploads.
Numbers come only from report.json, a null there reads "not measured"; the license and the original card come
only from the upstream folder (toolkit/hub/upstream.py). Metadata goes through huggingface_hub's ModelCardData.
The card says what the drafter is not (standalone, BF16), where to go instead, and how to run it. It names models,
never paths (hub/names.py): the target as the Hub model the drafter serves, the EXL3 target of the measurements by
its Hub ref or as "a local EXL3 quant at N bpw"; only Hub ids are linked.
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

from ..core.errors import ToolkitError
from ..core.files import Num, numbers, shown
from ..core.folders import read_json
from .howto import framing, requires_line, usage
from .names import is_hub_ref, link, public_report
from ..core.refs import is_repo_id
from .upstream import UPSTREAM, Upstream, license_fields, read_upstream, upstream_url

HUB = "https://huggingface.co"
TAGS = ["exl3", "dflash", "speculative-decoding"]
NOT_MEASURED = "not measured"
COLUMNS = ["Branch", "Bits", "Size", "Calibrated", "KL vs bf16", "Top-1 agreement", "τ (tokens/round)",
           "τ on exllamav3", "Speedup on exllamav3", "exllamav3 target", "Validation"]
MAIN_IMAGE = "tau_top1.png"


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


# Every number of report.json: its type, finite range and unit (core.files.Num); null is "not measured".
TAU = Num(0, 1024, "tokens per round", null=True)
NUMBERS = {"bits": Num(1, 8, "bits per weight"), "size_bytes": Num(0, 2**53, "bytes", whole=True, null=True),
           "kl": Num(0, 1e6, "nats", null=True), "top1": Num(0, 1, "(a share of positions)", null=True), "tau": TAU}
EXL3_NUMBERS = {"tau": TAU, "speedup": Num(0, 1e4, "times", null=True),
                "target_bits": Num(1, 16, "bits per weight", null=True)}
TEXT_FIELDS = ("revision", "target", "target_kind", "target_model", "target_sha", "device", "created",
               "toolkit_version", "exllamav3_version")
REPORT_NUMBERS = {"block_size": Num(1, 1024, "tokens", whole=True, null=True),
                  "tap_shift": Num(-1024, 1024, "layers", whole=True, null=True)}

ROW_TYPES = {   # field -> (check, what it must be) for the fields that are not numbers
    "folder": (lambda v: isinstance(v, str) and v.strip() != "", "a folder name"),
    "calibrated": (lambda v: isinstance(v, bool), "true or false"),
    "passed": (lambda v: v is None or isinstance(v, bool), "true, false or null"),
    "pushed": (lambda v: isinstance(v, bool), "true or false"),
    "branch": (lambda v: v is None or isinstance(v, str), "a branch name or null"),
    "exl3": (lambda v: v is None or isinstance(v, dict), "an object or null"),
}


EXL3_TYPES = {"target": (lambda v: v is None or isinstance(v, str), "a model name or null")}
BF16_TYPES = {"exl3": ROW_TYPES["exl3"]}
BF16_NUMBERS = {k: NUMBERS[k] for k in ("size_bytes", "tau")}


def check_fields(d: dict, where: str, types: dict, nums: dict[str, Num]) -> None:
    """Each present field of `d` of its type or range (and an `exl3` object's fields of theirs): one line naming it."""
    numbers(d, nums, "report.json", f"{where}.")
    for key, (ok, want) in types.items():
        if key in d and not ok(d[key]):
            raise ToolkitError(f"report.json: {where}.{key} must be {want}, got {shown(d[key])}")
    if isinstance(d.get("exl3"), dict):
        check_fields(d["exl3"], f"{where}.exl3", EXL3_TYPES, EXL3_NUMBERS)


def check_report(report, out_dir: str | Path | None = None) -> None:
    """Raise ToolkitError when report.json is not the version-1 schema this module renders: one line naming the
    field. With `out_dir`, every result folder must be a folder name inside it (never `../x` or an absolute path)."""
    if not isinstance(report, dict):
        raise ToolkitError(f"report.json: expected a JSON object, got a JSON {type(report).__name__}")
    if report.get("schema") != 1:
        raise ToolkitError(f"report.json: schema must be 1, got {shown(report.get('schema'))}")
    for key in ("model", "results"):
        if not report.get(key):
            raise ToolkitError(f"report.json: field {key!r} is missing or empty")
    if not isinstance(report["model"], str):
        raise ToolkitError(f"report.json: field 'model' must be a repo id string, got {shown(report['model'])}")
    for key in ("model", "revision", "target"):          # one printable line each: no text smuggled into the card
        if isinstance(report.get(key), str) and not report[key].isprintable():
            raise ToolkitError(f"report.json: field {key!r} must be one line of printable text, got {report[key]!r}")
    numbers(report, REPORT_NUMBERS, "report.json")
    for key in TEXT_FIELDS:                             # names and versions the card prints: text or null
        if report.get(key) is not None and not isinstance(report[key], str):
            raise ToolkitError(f"report.json: field {key!r} must be text or null, got {shown(report[key])}")
    widths = report.get("exl3_widths")
    if widths is not None and not (isinstance(widths, list) and all(isinstance(w, dict) for w in widths)):
        raise ToolkitError(f"report.json: field 'exl3_widths' must be a list of objects, got {shown(widths)}")
    for i, w in enumerate(widths or []):
        check_fields(w, f"exl3_widths[{i}]", EXL3_TYPES, {**EXL3_NUMBERS, "draft_tokens": Num(1, 1024, whole=True)})
    if not isinstance(report["results"], list):
        raise ToolkitError(f"report.json: field 'results' must be a list, got a JSON {type(report['results']).__name__}")
    if report.get("bf16") is not None:
        if not isinstance(report["bf16"], dict):
            raise ToolkitError("report.json: field 'bf16' must be an object or null")
        check_fields(report["bf16"], "bf16", BF16_TYPES, BF16_NUMBERS)
    for i, r in enumerate(report["results"]):
        if not isinstance(r, dict):
            raise ToolkitError(f"report.json: results[{i}] must be an object, got a JSON {type(r).__name__}")
        missing = [k for k in ("bits", "folder", "size_bytes", "calibrated") if k not in r]
        if missing:
            raise ToolkitError(f"report.json: results[{i}] lacks {', '.join(missing)}")
        check_fields(r, f"results[{i}]", ROW_TYPES, NUMBERS)
        if out_dir is not None:
            check_folder_inside(r["folder"], Path(out_dir), f"results[{i}].folder")


def inside_run(path: Path, out_dir: Path) -> Path:
    """`path` when it resolves (links followed) inside the run folder `out_dir`; else one line: a file linked out of
    the run is never read, printed or published."""
    real, root = path.resolve(), out_dir.resolve()
    if real != root and root not in real.parents:
        raise ToolkitError(f"--from: {path} resolves to {real}, outside {out_dir}; refusing to read it")
    return path


def run_upstream(out_dir: Path) -> Path | None:
    """OUT/upstream confined like the bitrate folders: the folder and each file in it inside the run (or None)."""
    up = out_dir / UPSTREAM
    if not up.exists() and not up.is_symlink():
        return None
    inside_run(up, out_dir)
    for p in sorted(up.iterdir()) if up.is_dir() else []:
        inside_run(p, out_dir)
    return up


def check_folder_inside(folder: str, out_dir: Path, field: str) -> Path:
    """`out_dir / folder` when it names a folder inside `out_dir` (after resolving `..` and links), else one line."""
    root = out_dir.resolve()
    path = (out_dir / folder).resolve()
    if Path(folder).is_absolute() or path == root or root not in path.parents:
        raise ToolkitError(f"report.json: {field} {folder!r} is not a folder inside {out_dir}; refusing to read "
                           "files outside the run folder")
    return out_dir / folder


def card_data(report: dict, up: Upstream | None = None) -> ModelCardData:
    """base_model (the drafter, when it is a Hub model) quantized, the upstream license fields, exllamav3, tags."""
    hub = is_repo_id(report["model"]) and "/" in report["model"]
    lic = license_fields(up or Upstream(), report["model"], report.get("revision")) if hub else {}
    return ModelCardData(
        base_model=report["model"] if hub else None,
        base_model_relation="quantized" if hub else None,
        **lic,
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


def exl3_cells(m: dict | None) -> list[str]:
    """τ, speedup and the named target (with its bitrate) measured on exllamav3, or "not measured"; `m` comes from
    public_report, so its target is a Hub ref or already "a local EXL3 quant at N bpw"."""
    if not m:
        return [NOT_MEASURED] * 3
    target = m.get("target")
    if target and not target.startswith("a local"):
        bits = m.get("target_bits")
        target = target + (f" ({float(bits):.2f} bpw)" if bits is not None else "")
    speed = m.get("speedup")
    return [_num(m.get("tau"), ".2f"), NOT_MEASURED if speed is None else f"{speed:.2f}×", target or NOT_MEASURED]


def table(report: dict, branches: dict[str, str], repo: str | None, bits: float | None = None) -> list[str]:
    """The measured table: one row per result (all of them, uploaded or not), then the bf16 reference."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in report["results"]:
        if bits is not None and float(r["bits"]) != float(bits):
            continue
        cells = [_branch_cell(r, branches, repo), f"{float(r['bits']):.2f}", human_size(r["size_bytes"]),
                 "yes" if r["calibrated"] else "no", _num(r.get("kl"), ".4g"), _pct(r.get("top1")),
                 _num(r.get("tau"), ".2f"), *exl3_cells(r.get("exl3")), _check(r.get("passed"))]
        lines.append("| " + " | ".join(cells) + " |")
    bf16 = report.get("bf16") or {}
    ref = [link(report["model"], "bf16 original"), "16.00", human_size(bf16.get("size_bytes")), "n/a",
           "0 (reference)", "100% (reference)", _num(bf16.get("tau"), ".2f"), *exl3_cells(bf16.get("exl3")), "n/a"]
    lines.append("| " + " | ".join(ref) + " |")
    return lines


def _about(report: dict) -> list[str]:
    model, target = report["model"], report.get("target")
    rev = f" at revision `{report['revision']}`" if report.get("revision") else ""
    target_txt = f" for {link(target)}" if target else ""
    unknown = "unknown"
    return [
        f"EXL3 quantizations of the DFlash block-diffusion drafter {link(model)}{rev}{target_txt}.",
        "",
        f"Made with dflash-exl3-toolkit {report.get('toolkit_version') or unknown}"
        + (f" and exllamav3 {report['exllamav3_version']}" if report.get("exllamav3_version") else
           " (no exllamav3 version recorded)")
        + f" on {report.get('created') or unknown}; block size "
        f"{report.get('block_size') or unknown}, tap shift {report.get('tap_shift', unknown)}.",
    ]


def _tau_words(report: dict) -> str:
    """What the "τ (tokens/round)" column is in this run: measured where and how, or why it is empty."""
    rows = [*(report.get("results") or []), report.get("bf16") or {}]
    if any(isinstance(r, dict) and r.get("tau") is not None for r in rows):
        device = report.get("device")
        return ("greedy decoding through this toolkit's torch runtime with the BF16 target, "
                + (f"measured on {device}" if device else "on a device the report does not name"))
    if report.get("target_kind") == "exl3":
        return ("empty in this run: that column decodes with a BF16 (transformers) target, and this run's target was "
                "an EXL3 quant, whose τ is the \"τ on exllamav3\" column")
    if not report.get("target"):
        return "not measured in this run: it had no target to decode with"
    return "not measured in this run (its check was skipped)"


def _method(report: dict) -> list[str]:
    return [
        "KL is the mean KL divergence of each quantized drafter's next-token distribution from the bf16 "
        "drafter's, and top-1 agreement the share of positions where both pick the same token, over the "
        "block positions of the held-out check prompts (the recipe's check prompts: none of them calibrated the "
        f"quants). τ is the mean number of tokens accepted per verification round with the target: {_tau_words(report)}. "
        "\"τ on exllamav3\" and \"Speedup on exllamav3\" are "
        "measured on exllamav3 itself with the named EXL3 target at the bitrate shown, the speedup against "
        "plain decoding of the same target in the same process. \"not measured\" means the run skipped that "
        "measurement; no number is estimated.",
    ]


def _license(report: dict, up: Upstream) -> list[str]:
    model, rev = report["model"], report.get("revision")
    if not is_hub_ref(model):
        return [f"These weights are a quantization of the local drafter `{model}`: its license applies."]
    fields = license_fields(up, model, rev)
    files = ", ".join(f"[{n}]({upstream_url(model, rev, n)})" for n in up.licenses)
    if fields:
        name = fields["license"] + (f" ({fields['license_name']})" if fields.get("license_name") else "")
        terms = f"; terms: <{fields['license_link']}>" if fields.get("license_link") else ""
        text = (f"These weights are a quantization of [{model}]({HUB}/{model}), so its license applies: "
                f"**{name}**, as its card's metadata states{terms}.")
    else:
        text = (f"The upstream card's metadata names no license; the terms of [{model}]({HUB}/{model}) apply "
                "to these quantized weights, read them there.")
    return [text] + (["", f"The upstream license file(s): {files}."] if files else [])


def _original(report: dict, up: Upstream) -> list[str]:
    model, rev = report["model"], report.get("revision")
    link = f"[{model}]({upstream_url(model, rev)})" if is_hub_ref(model) else f"`{model}` (a local folder)"
    if up.readme is None:
        return [f"This run's upstream folder holds no README.md, so the original card is not reproduced here; "
                f"read it at {link}."]
    at = f" at revision `{rev}`" if rev else ""
    return [f"Below is the README.md of {link}{at}, reproduced verbatim for attribution and the DFlash details "
            f"(its metadata block removed). Its relative links refer to files of {link}.", "", up.readme.rstrip()]


def default_branches(report: dict, out_dir: Path | None = None) -> dict[str, str]:
    """folder -> branch of the rows push uploads: the report's own `branch`, or with `out_dir` the names push
    gives by default ({bits:.1f}bpw) to the folders that exist there."""
    rows = pick_pushed(report["results"])
    if out_dir is None:
        return {r["folder"]: r.get("branch") or f"{float(r['bits']):.1f}bpw" for r in rows}
    return {r["folder"]: f"{float(r['bits']):.1f}bpw" for r in rows if (out_dir / r["folder"]).is_dir()}


def render_card(report: dict, repo: str | None = None, bits: float | None = None, *,
                branches: dict[str, str] | None = None, image: str | None = None,
                upstream: str | Path | None = None) -> str:
    """README.md text (YAML front matter + body) for the main branch, or for one bitrate's branch when `bits`.

    `branches` maps result folder -> Hub branch for the rows that are uploaded; by default the report's own
    `branch` of every pushed row. `image` is a file next to the card (tau_top1.png) to embed. `upstream` is the
    run's upstream folder (README.md, LICENSE*) for the license and the original card.
    """
    check_report(report)
    up = read_upstream(upstream)
    report = public_report(report, up.metadata)    # names, never paths of this machine
    if branches is None:
        branches = default_branches(report)
    if bits is not None and not any(float(r["bits"]) == float(bits) for r in report["results"]):
        have = ", ".join(f"{float(r['bits']):.1f}" for r in report["results"])
        raise ToolkitError(f"render_card: bits={bits} is not in report results (have {have})")
    title = f"# {_name(report)} EXL3" + (f" {float(bits):.1f} bpw" if bits is not None else "")
    body = [title, "", *_about(report), "", *framing(report, has_card=up.readme is not None), "",
            requires_line(report), ""]
    if bits is not None:
        main = link(repo, "the main branch") if repo else "the main branch"
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
    body += usage(report, repo, shown[0][1] if shown else "4.0bpw")
    body += ["", "## License", "", *_license(report, up), "", "## Original model card", "", *_original(report, up)]
    content = f"---\n{card_data(report, up).to_yaml()}\n---\n\n" + "\n".join(body) + "\n"
    return str(ModelCard(content))


def run_card(out_dir: str | Path, repo: str | None = None, bits: float | None = None) -> str:
    """The card `python -m toolkit.push --from out_dir` uploads (default branch names): main's, or one bitrate's."""
    out = Path(out_dir)
    if repo is not None and not (is_repo_id(repo) and "/" in repo):
        raise ToolkitError(f"--repo must be USER/NAME, got {repo!r}")
    report = read_json(inside_run(out / "report.json", out), "--from: ",
                       "no report.json (run python -m toolkit.quantize first)")
    check_report(report, out)
    image = MAIN_IMAGE if bits is None and (out / MAIN_IMAGE).is_file() else None
    return render_card(report, repo, bits, branches=default_branches(report, out), image=image,
                       upstream=run_upstream(out))
