"""The card's words around the numbers: what the drafter is and is not, the exllamav3 it needs, how to run it.

Model names, versions and the recommended draft length come from report.json; when the report lacks one the
text says so rather than guessing. Run instructions cover exllamav3, TabbyAPI (its config.yml draft-model keys)
and this toolkit's generate command and chat app.
"""

from __future__ import annotations

from .names import link as _link


def framing(report: dict, has_card: bool) -> list[str]:
    """What this repository is and is not, with the drafter and target named."""
    drafter, target = report["model"], report.get("target")
    tgt = _link(target) if target else "its target model"
    tgt_short = target or "the target"
    lines = [
        "## What this is, and what it is not",
        "",
        f"- **Not a standalone model.** This is a DFlash draft model for {tgt}. It proposes blocks of tokens that "
        f"{tgt_short} then verifies, so it is useful only next to that target, in a speculative-decoding runtime "
        "that supports DFlash draft models and EXL3 weights. On its own it is neither a chat nor a completion model.",
        "- **Not the BF16 checkpoint.** These are EXL3 (ExLlamaV3) weights, not the original BF16 Transformers "
        "checkpoint. Load them only with loaders or servers that read EXL3 weights for the DFlash draft "
        "architecture: exllamav3, or a server built on it such as TabbyAPI.",
        f"- **Other serving stacks: take the upstream model.** If your stack expects BF16 weights or the standard "
        f"DFlash repository layout, use {_link(drafter)} instead.",
        f"- **No fine-tuning.** The weights are those of {_link(drafter)}, only quantized; nothing was trained. The "
        f"capabilities, limitations, license terms and safety considerations of {drafter} and of {tgt_short} "
        "still apply.",
        "- **Quantization changes numbers.** Quantizing can change the drafter's quality and numerical behaviour. "
        "The target still decides every token it emits; what a weaker drafter costs is fewer accepted tokens per "
        "round, so less speed. The table below measures that per bitrate, where it was measured.",
    ]
    if has_card:
        lines.append("- The upstream model card is reproduced at the end for attribution and the DFlash details.")
    return lines


def requires_line(report: dict) -> str:
    version = report.get("exllamav3_version")
    if version:
        return f"**Requires exllamav3 >= {version}**, the version these quants were made and measured with."
    return ("**exllamav3 version: none recorded.** No exllamav3 made or measured the files this report describes (a "
            "CPU preview, or a run that did not record it); use an exllamav3 release with DFlash draft model support.")


def draft_tokens(report: dict) -> int | None:
    """The draft length (tokens per round) the run recommends, if it recorded one."""
    n = report.get("recommended_draft_tokens")
    return int(n) if n else None


def _tabby(report: dict, local: str) -> list[str]:
    n = draft_tokens(report)
    target = report.get("target") or "the target model"
    lines = [
        "### With TabbyAPI",
        "",
        f"TabbyAPI serves the drafter next to the target through exllamav3. Put the EXL3 target (a quant of {target}) "
        f"and `{local}` in TabbyAPI's models folder and set in `config.yml`:",
        "",
        "```yaml",
        "model:",
        "  model_dir: models",
        "  model_name: TARGET",
        "draft_model:",
        "  draft_model_dir: models",
        f"  draft_model_name: {local}",
    ]
    if n is not None:
        lines.append(f"  draft_num_tokens: {n}")
    lines.append("```")
    lines += ["", f"`draft_num_tokens: {n}` is the draft length this run recommends." if n is not None else
              "This run recommends no draft length, so `draft_num_tokens` is left at the draft model's default."]
    return lines


def usage(report: dict, repo: str | None, branch: str) -> list[str]:
    """Download, then run with exllamav3, TabbyAPI and this toolkit."""
    repo = repo or "USER/REPO"
    local = f"{report['model'].split('/')[-1]}-exl3-{branch}"
    target = report.get("target") or "the target model"
    n = draft_tokens(report)
    gen_extra = f", num_draft_tokens={n}" if n is not None else ""
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
        f"                      draft_model=draft, draft_cache=draft_cache{gen_extra})",
        "print(generator.generate(prompt=\"Hello\", max_new_tokens=200))",
        "```",
        "",
        *_tabby(report, local),
        "",
        "### With dflash-exl3-toolkit",
        "",
        "```sh",
        f"python -m toolkit.generate --backend exllamav3 --target TARGET --draft {local} "
        "--prompt \"Hello\" --compare-ar",
        f"python app.py --backend exllamav3 --target TARGET --draft {local}   # the chat app",
        "```",
    ]
