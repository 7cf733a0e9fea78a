"""The dry run for a target not on disk yet (README step 3 before step 1): every step planned from the recipe's
shapes, the target's kind and size from its name (or, for a placeholder that is neither a folder nor a Hub id, the
one-GPU path's EXL3 target, labelled as assumed), a folder without weights planned from its config, what must be
made or downloaded first, and the pages quoting the plan's peak as it prints it."""

from __future__ import annotations

import re

import pytest
from test_quantize_offline import ROOT, dry_run

from toolkit.quant.offline import named_bits


@pytest.mark.parametrize("ref, bits", [("Qwen3.6-35B-A3B-exl3-4.0bpw", 4.0), ("USER/X-exl3@6.0bpw", 6.0),
                                       ("me/x_3.5bpw", 3.5), ("USER/X-exl3", 4.0), ("Qwen/Qwen3.6-35B-A3B", None)])
def test_the_bitrate_a_name_says(ref, bits):
    assert named_bits(ref) == bits


def test_a_local_exl3_target_not_made_yet_plans_every_step(tmp_path):
    r = dry_run(tmp_path, "--target", "Qwen3.6-35B-A3B-exl3-4.0bpw")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "(EXL3 on exllamav3, not here yet: planned from the recipe's shapes)" in out.splitlines()[0]
    steps = re.findall(r"^  (\w+) +\d+\.\d GiB", out, re.M)
    assert steps == ["target", "calibrate", "convert", "check", "speed"]
    assert re.search(r"peak: 18\.\d GiB in step target: fits a 24 GB card", out)
    assert "size unknown" not in out and "BF16 (transformers)" not in out
    assert re.search(r"Qwen3\.6-35B-A3B-exl3-4\.0bpw: the target, EXL3 at 4\.0 bpw \(from its name\), about 17\.\d GiB: "
                     r"not on disk yet; make it first", out)
    assert re.search(r"hf download Qwen/Qwen3\.6-35B-A3B --local-dir Qwen3\.6-35B-A3B .*BF16, about 6\d\.\d GiB", out)
    assert "convert_model -i Qwen3.6-35B-A3B -o Qwen3.6-35B-A3B-exl3-4.0bpw -w exl3-work -b 4.0" in out
    assert not (tmp_path / "out").exists()


def test_a_hub_quant_not_cached_is_a_download_of_its_named_size(tmp_path):
    r = dry_run(tmp_path, "--target", "USER/Qwen3.6-35B-A3B-exl3@4.0bpw")
    assert r.returncode == 0, r.stderr
    assert re.search(r"USER/Qwen3\.6-35B-A3B-exl3@4\.0bpw: the target, EXL3 at 4\.0 bpw \(from its name\), "
                     r"about 17\.\d GiB\n", r.stdout)
    assert "make it first" not in r.stdout and re.search(r"^  speed ", r.stdout, re.M)


def test_a_target_whose_name_says_no_exl3_is_planned_as_bf16(tmp_path):
    r = dry_run(tmp_path, "--target", "USER/Qwen3.6-35B-A3B-copy")
    assert r.returncode == 0, r.stderr
    assert "(transformers, not here yet" in r.stdout and "does not fit a 24 GB card" in r.stdout
    assert re.search(r"the target, BF16 \(transformers\), about 6\d\.\d GiB", r.stdout)


def test_the_bf16_hint_for_one_24_gb_card(tmp_path):
    r = dry_run(tmp_path, "--target", "USER/Qwen3.6-35B-A3B-copy")
    assert re.search(r"on one 24 GB GPU pass an EXL3 quant of it as --target instead: at 4\.0 bpw about 17\.\d GiB",
                     r.stdout)


def test_the_readme_placeholder_is_planned_as_the_one_gpu_exl3_target_and_the_pages_agree(tmp_path):
    r = dry_run(tmp_path, "--target", "TARGET")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert ("note: target TARGET is neither a folder here nor a Hub id (USER/NAME): planned as an EXL3 quant at 4.0 bpw "
            "(assumed: the one-GPU path) of Qwen/Qwen3.6-35B-A3B") in out
    peak = re.search(r"peak: (\d+\.\d) GiB in step target: fits a 24 GB card", out).group(1)
    readme = (ROOT / "README.md").read_text().split("3. **Dry run**", 1)[1].split("4. **Run**", 1)[0]
    assert "--target TARGET --dry-run" in readme.replace("\n", " ").replace("   ", " ")
    assert f"~{peak} GiB" in readme                                 # README step 3 quotes what it prints
    assert f"about {peak} GiB" in (ROOT / "docs" / "quantize.md").read_text()
    assert re.search(rf"the dry run of README step 3, [^|]*: peak {re.escape(peak)} GiB", (ROOT / "docs/results.md").read_text())
