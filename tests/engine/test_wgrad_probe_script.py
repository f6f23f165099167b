"""scripts/p2/wgrad_probe.py on the CPU: its shapes, its checks and its table, and its --compile-only run (the Gluon
weight-gradient kernel built for sm_90 without a GPU); its children run on a GPU."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from child_env import compile_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def probe():
    sys.path.insert(0, str(ROOT / "scripts" / "p2"))
    spec = importlib.util.spec_from_file_location("wgrad_probe", ROOT / "scripts" / "p2" / "wgrad_probe.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["wgrad_probe"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_shapes_name_the_products_and_their_flop(probe):
    p2 = probe.SHAPES["p2_t8192_all"]
    assert p2.outputs == [(2048, 4096), (2048, 4096), (4096, 2048)]
    assert (p2.rows, p2.flop) == (65536, 2 * 65536 * 3 * 2048 * 4096)
    assert probe.SHAPES["qwen3_t8192_gate_up"].outputs == [(768, 2048)] * 2
    assert probe.SHAPES["mixtral_t4096_down"].outputs == [(4096, 14336)]
    assert probe.SHAPES["deepseek_t32768_gate_up"].outputs == [(1408, 2048)] * 2
    assert len(probe.SHAPES) == 18  # six models' token counts, three product sets each


def test_operands_share_x_and_view_dg_du_in_one_tensor(probe, seed):
    shape = probe.Shape(16, 4, 2, 64, 48, "all")
    pairs = probe.operands(shape, torch.Generator().manual_seed(seed), "cpu")
    (dg, x), (du, x2), (dy, aw) = pairs
    assert x is x2 and dg.stride() == du.stride() == (96, 1) and du.data_ptr() == dg.data_ptr() + 48 * 2
    assert dy.shape == (32, 64) and aw.shape == (32, 48)


def test_checked_experts_take_the_extremes_first(probe, seed):
    bounds = [0, 5, 5, 40, 41, 90, 100, 130, 131, 200]  # counts 5 0 35 1 49 10 30 1 69
    chosen = probe.checked_experts(bounds, torch.Generator().manual_seed(seed))
    assert chosen[:3] == [1, 8, 0] and len(chosen) == len(set(chosen)) == 6  # the last expert is the busiest


def test_wrong_finds_nan_and_a_wrong_expert(probe, seed):
    generator = torch.Generator().manual_seed(seed)
    shape = probe.Shape(40, 4, 2, 32, 16, "down")
    pairs = probe.operands(shape, generator, "cpu")
    bounds = [0, 30, 30, 61, 80]
    outs = [torch.stack([pairs[0][0][s:e].float().t() @ pairs[0][1][s:e].float() for s, e in
                         zip(bounds[:-1], bounds[1:], strict=True)]).to(torch.bfloat16)]  # fmt: skip
    assert probe.wrong(pairs, outs, bounds, [0, 1, 2, 3]) is None
    outs[0][2, 0, 0] += 1000.0
    assert "relative error" in probe.wrong(pairs, outs, bounds, [0, 2])
    outs[0][3, 1, 1] = float("nan")
    assert "non-finite" in probe.wrong(pairs, outs, bounds, [0])


@pytest.mark.parametrize("refuses", [0, 1, 2], ids=["grouped_mm", "on_copies", "mm_loop"])
def test_baseline_computes_the_products_by_each_path(probe, refuses, monkeypatch, seed):
    """torch._grouped_mm as it is, on contiguous copies where it refuses the column views, a torch.mm per expert
    where it refuses those too: each path's products against float64 (an empty expert's exact zeros)."""
    generator = torch.Generator().manual_seed(seed)
    pairs = probe.operands(probe.Shape(40, 4, 2, 32, 16, "all"), generator, "cpu")
    bounds = [0, 30, 30, 61, 80]
    grouped_mm = torch._grouped_mm

    def picky(a, b, offs):  # refuses column views (refuses=1) or everything (refuses=2)
        if refuses == 2 or (refuses == 1 and a.stride(1) != a.shape[0]):
            raise RuntimeError("refused\nsecond line")
        return grouped_mm(a, b, offs=offs)

    monkeypatch.setattr(torch, "_grouped_mm", picky)
    call, note = probe.baseline(pairs, torch.tensor(bounds, dtype=torch.int32), bounds)
    assert note is None if refuses == 0 else "refused" in note and "second" not in note
    outs = call([torch.full((4, a.shape[1], b.shape[1]), float("nan"), dtype=torch.bfloat16) for a, b in pairs])
    for (a, b), out in zip(pairs, outs, strict=True):
        for e in range(4):
            expected = a[bounds[e] : bounds[e + 1]].double().t() @ b[bounds[e] : bounds[e + 1]].double()
            assert torch.allclose(out[e].double(), expected, rtol=2**-7, atol=1e-2), e
        assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_table_gives_tflops_fractions_and_the_geomean(probe):
    def ok(tflops):
        return dict(check="ok", tflops=tflops)

    runs = {
        "torch": dict(results={"p2_t8192_all": ok(600.0), "p2_t8192_down": ok(500.0)}),
        "coop_m128n256k64_s3": dict(
            results={"p2_t8192_all": ok(540.0), "p2_t8192_down": dict(check="WRONG: relative error 0.5")}
        ),
        "coop_m128n128k64_s5": dict(results={"p2_t8192_all": ok(600.0), "p2_t8192_down": ok(550.0)}),
    }
    text = probe.table(runs, ["p2_t8192_all", "p2_t8192_down"])
    lines = text.splitlines()
    assert lines[0] == "c1 = coop_m128n256k64_s3" and lines[1] == "c2 = coop_m128n128k64_s5"
    assert "540 0.90" in text and "WRONG" in text and "550 1.10" in text
    assert lines[-1].split()[-3:] == ["1.000", "0.900", f"{(1.0 * 1.1) ** 0.5:.3f}"]


@pytest.mark.slow
def test_compile_only_builds_a_config_for_sm90_unserialised_within_the_limits(tmp_path):
    """One config for one, two and three products (bf16) and three in fp32, compiled for sm_90 by the probe itself
    (``--compile-only``): no stack, within 227 KB, wgmma not serialised by ptxas, four device descriptors."""
    env = compile_env(ROOT)
    done = subprocess.run(
        [
            sys.executable,
            "scripts/p2/wgrad_probe.py",
            "--compile-only",
            "--configs",
            "coop_m128n128k64_s5,coop_m128n128k64_s5+gather",
        ]
        + ["--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((tmp_path / "wgrad_probe_compile.json").read_text())["compile"]
    assert {(row["problems_in_launch"], row["out"]) for row in rows} == {(1, "bf16"), (2, "bf16"), (3, "bf16"),
                                                                           (3, "fp32")}  # fmt: skip
    for row in rows:
        assert row["error"] is None and row["problems"] == [], row
        assert row["stack"] == 0 and row["shared"] <= 232448 and row["serialized"] == "no", row
        assert max(row["partition_registers"]) <= 256 and row["wgmma"] > 0 and row["descriptors"] == 4, row
