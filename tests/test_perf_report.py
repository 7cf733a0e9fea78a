"""experiments.perf_report (the performance model of docs/performance.md) on a fake perf.json."""

from __future__ import annotations

import json

import pytest

from toolkit.core.errors import run_cli


def fake_perf() -> dict:
    """A small perf.json in the device script's format (made-up numbers)."""
    combos = []
    for bits in (4.0, 6.0, 8.0):
        for B in (8, 16):
            for c in (1, 4, 16, 32):
                for ctx in (1024, 8192, 32768):
                    ar = 6.0 + 0.1 * c + ctx / 8192
                    terms = {"draft": 1.5 + bits / 8, "verify": ar * (1.1 + B / 40), "sample": 0.1, "rewind": 0.2 * c / 8,
                             "draft_update": 0.3, "runtime": 0.01 * c}
                    combos.append({"bits": bits, "B": B, "c": c, "ctx": ctx, "t_ar_ms": ar, "t_round_ms": sum(terms.values()),
                                   "terms": terms, "vram_gib": 17 + c * ctx / 32768 * 0.9, "accepted": 7 if B == 16 else 5})
    return {"date": "2026-12-02 16:00:00 UTC", "device": "NVIDIA H200", "exllamav3": "1.6.5", "torch": "2.11.0+cu130",
            "command": "source .device/on-device.sh && python tests/gpu/perf_synth.py", "combos": combos,
            "memory": {"model": {"1": {"4.0": {"32768": 19.1}, "6.0": {"32768": 19.3}}}, "cuda_overhead_gib": 0.6},
            "synth": {"target": {"seconds": 95.0, "size": "18.42 GB"}}, "generator_check": [], "notes": ["fake"]}


def test_perf_report(tmp_path):
    from experiments.perf_report import main as perf_main

    src = tmp_path / "perf.json"
    src.write_text(json.dumps(fake_perf()))
    md, png = tmp_path / "docs" / "performance.md", tmp_path / "docs" / "performance.png"
    perf_main(["--perf", str(src), "--md", str(md), "--png", str(png)])
    text = md.read_text()
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "| 16 | 1 | 1k |" in text and "7.63" in text and "3.61" in text
    assert "24 GB" in text and "48 GB" in text and ("PASS" in text or "FAIL" in text)
    assert "random" in text and "B200" in text
    # a perf.json from before the move names tests/gpu/perf_synth.py: the report shows today's command
    assert "python -m experiments.perf_synth" in text and "tests/gpu" not in text
    assert "python -m experiments.perf_report --perf" in text


def test_perf_errors(tmp_path, capsys):
    from experiments.perf_report import main as perf_main

    with pytest.raises(SystemExit) as e:
        run_cli(lambda: perf_main(["--perf", str(tmp_path / "none.json"), "--md", str(tmp_path / "x.md")]))
    assert e.value.code == 2 and "no such file" in capsys.readouterr().err
    (tmp_path / "empty.json").write_text(json.dumps({"combos": []}))
    with pytest.raises(SystemExit):
        run_cli(lambda: perf_main(["--perf", str(tmp_path / "empty.json"), "--md", str(tmp_path / "x.md")]))
    assert "no measured combinations" in capsys.readouterr().err
