"""Step 3 on CPU: Hessians from forward hooks, what each drafter Linear sees, and exllamav3's -hess layout."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from torch import nn

from toolkit.core.errors import ToolkitError
from toolkit.assets.fixtures import drafter_config, random_drafter
from toolkit.quant.blocks import anchors
from toolkit.quant.calibrate import HessianAccumulator, calibrate, write_hessians
from toolkit.quant.validate import linear_keys


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 5), nn.Linear(5, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_accumulator_matches_xtx():
    torch.manual_seed(0)
    m = Small()
    x1, x2 = torch.randn(4, 3), torch.randn(2, 7, 3)
    with HessianAccumulator(m) as acc:
        m(x1), m(x2)
    X = torch.cat([x1, x2.reshape(-1, 3)])
    assert acc.rows == {"a": 18, "b": 18}
    assert torch.allclose(acc.H["a"], X.T @ X, atol=1e-5)
    hb = torch.relu(m.a(X))
    assert torch.allclose(acc.mean()["b"], hb.T @ hb / 18, atol=1e-5)
    m(x1)                                     # hooks are gone after the with-block
    assert acc.rows["a"] == 18


def test_unknown_linear_name():
    with pytest.raises(ToolkitError, match="no nn.Linear named 'c'"):
        HessianAccumulator(Small(), ["a", "c"])


def test_drafter_rows_per_linear():
    """fc: context rows; q: block rows; k/v: context + block rows; o/gate/up/down: block rows."""
    cfg = drafter_config(16, [0, 1], 5, 4, vocab_size=32, window=8)
    m = random_drafter(cfg)
    n, B = 6, 4
    taps, noise = torch.randn(1, n, 32), torch.randn(1, B, 16)
    with HessianAccumulator(m, linear_keys(m.config)) as acc:
        m(noise, taps, torch.arange(n + B)[None])
    assert acc.rows["fc"] == n
    for i in range(2):
        p = f"layers.{i}.self_attn."
        assert acc.rows[p + "q_proj"] == B and acc.rows[p + "o_proj"] == B
        assert acc.rows[p + "k_proj"] == acc.rows[p + "v_proj"] == n + B
        assert acc.rows[f"layers.{i}.mlp.down_proj"] == B
    # k_proj's Hessian is the context rows (hidden_norm(fc(taps))) plus the block rows (input_layernorm(noise))
    ctx = m.context(taps)[0]
    blk = m.layers[0].input_layernorm(noise)[0]
    X = torch.cat([ctx, blk]).detach()
    assert torch.allclose(acc.H["layers.0.self_attn.k_proj"], X.T @ X, atol=1e-4)
    # down_proj's input is act(gate) * up of the post-attention norm output
    assert acc.H["layers.0.mlp.down_proj"].shape == (32, 32)


def test_hessian_files_in_exllamav3_layout(tmp_path):
    hs = {"fc": torch.eye(4), "layers.0.self_attn.q_proj": 2 * torch.eye(3)}
    out = write_hessians(hs, tmp_path / "hess", {"fc": 10})
    assert sorted(p.name for p in out.iterdir()) == ["fc.safetensors", "layers.0.self_attn.q_proj.safetensors"]
    with safe_open(str(out / "layers.0.self_attn.q_proj.safetensors"), framework="pt") as f:
        assert list(f.keys()) == ["hin"]
        h = f.get_tensor("hin")
    assert h.dtype == torch.float32 and torch.equal(h, 2 * torch.eye(3))
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_hessian_write_failure_leaves_nothing(tmp_path, monkeypatch):
    import errno
    import toolkit.quant.calibrate as c

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(c, "save_file", full)
    with pytest.raises(ToolkitError, match="cannot write Hessians .*No space left"):
        write_hessians({"fc": torch.eye(2)}, tmp_path / "hess")
    assert list(tmp_path.iterdir()) == []


def test_calibrate_on_tiny_pair(tmp_path, pair):
    from toolkit.dflash import load_drafter
    from toolkit.quant.blocks import load_target
    from toolkit.runtime.backend import encode_chat

    t, d = pair
    target, tok = load_target(t)
    drafter = load_drafter(d)
    ids = [encode_chat(tok, p) for p in ["Return the sum of two numbers.", "Open a file."]]
    keys = linear_keys(drafter.config)
    rows = calibrate(drafter, target, ids, keys, 2, tmp_path / "hess", progress=False)
    B = drafter.config.block_size
    blocks_n = sum(len(anchors(len(i), 2)) for i in ids)
    assert rows["layers.0.self_attn.q_proj"] == blocks_n * B
    assert rows["layers.0.self_attn.k_proj"] == rows["fc"] + blocks_n * B
    assert {p.stem for p in (tmp_path / "hess").glob("*.safetensors")} == set(keys)
    with safe_open(str(tmp_path / "hess" / "fc.safetensors"), framework="pt") as f:
        h = f.get_tensor("hin")
    n = drafter.fc.in_features
    assert h.shape == (n, n) and torch.allclose(h, h.T, atol=1e-5) and torch.linalg.eigvalsh(h.double()).min() > -1e-4
    with pytest.raises(ToolkitError, match="no \\[calibration\\] prompts"):
        calibrate(drafter, target, [], keys, 2, tmp_path / "h2", progress=False)
