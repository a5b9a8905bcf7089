"""Regenerates docs/recorder_example.png: the picture of a recorded run that the docs show.

    python tools/make_plot_example.py [--out docs/recorder_example.png] [--steps 400] [--blocks 12]

The run is synthetic (no training needed, the same picture on every machine): a GPT-2-small-like model
(148 parameters in 12 blocks), norms settling with noise and clipped at max_norm=1, a spike in one
block's MLP six steps before that block's attention gradients turn NaN, that step skipped as a
GradScaler skips it, and the loss scale halved after it. The records go through JSONLSink into a JSONL
file and are drawn from there by nanscan.plot.plot_run, the path a real run takes.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import numpy as np

from nanscan.plot import plot_run
from nanscan.records import StepRecord
from nanscan.sinks import JSONLSink

BLOCK = [
    "ln_1.weight",
    "ln_1.bias",
    "attn.c_attn.weight",
    "attn.c_attn.bias",
    "attn.c_proj.weight",
    "attn.c_proj.bias",
    "ln_2.weight",
    "ln_2.bias",
    "mlp.c_fc.weight",
    "mlp.c_fc.bias",
    "mlp.c_proj.weight",
    "mlp.c_proj.bias",
]


def gpt2_names(blocks: int) -> list[str]:
    """Parameter names as GPT-2 (Hugging Face) has them: 12 blocks give GPT-2 small's 148."""
    body = [f"transformer.h.{b}.{name}" for b in range(blocks) for name in BLOCK]
    return [
        "transformer.wte.weight",
        "transformer.wpe.weight",
        *body,
        "transformer.ln_f.weight",
        "transformer.ln_f.bias",
    ]


def synthetic_run(names: list[str], steps: int, nan_step: int, spike_step: int, seed: int = 0) -> list[StepRecord]:
    """Records of a run with the events of the module notes at ``spike_step`` and ``nan_step``."""
    rng = np.random.default_rng(seed)
    # Per-parameter scale: biases and layer norms small, weights larger, deeper blocks a little smaller.
    scale = np.array(
        [
            (0.05 if name.endswith("bias") or ".ln_" in name else 0.5) * (1 + 0.3 * rng.standard_normal()) ** 2
            for name in names
        ]
    )
    spiked = [i for i, name in enumerate(names) if ".h.5.mlp.c_fc" in name]
    broken = [i for i, name in enumerate(names) if ".h.5.attn.c_attn" in name]
    history: list[np.ndarray] = []
    records = []
    for step in range(steps):
        drift = 3.0 * math.exp(-step / 40) + 1.0  # early steps large, then settling
        norm = scale * drift * np.exp(0.15 * rng.standard_normal(len(names)))
        if spike_step <= step < spike_step + 3:
            norm[spiked] *= 30 / (1 + step - spike_step)
        nan_count = np.zeros(len(names), dtype=int)
        if step == nan_step:
            nan_count[broken] = [12, 3]
            norm[broken] = math.nan
        window = np.array(history[-20:]) if len(history) >= 5 else None
        ratio = norm / np.median(window, axis=0) if window is not None else np.full(len(names), math.nan)
        history.append(np.where(np.isfinite(norm), norm, scale))
        total = float(np.sqrt(np.sum(norm**2)))
        finite = not nan_count.any()
        clip = min(1.0, 1.0 / (total + 1e-6)) if finite else None
        records.append(
            StepRecord(
                step=step,
                names=names,
                nan_count=nan_count.tolist(),
                inf_count=[0] * len(names),
                min=(-norm / 10).tolist(),
                max=(norm / 10).tolist(),
                norm=norm.tolist(),
                spike_ratio=ratio.tolist(),
                total_norm=total,
                finite=finite,
                clip_coef=clip,
                max_norm=1.0 if finite else None,
                skipped=not finite,
                loss_scale=65536.0 if step <= nan_step else 32768.0,
                spike_factor=5.0,
            )
        )
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs" / "recorder_example.png"
    )
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--blocks", type=int, default=12)
    args = parser.parse_args()
    names = gpt2_names(args.blocks)
    records = synthetic_run(names, args.steps, nan_step=args.steps * 3 // 4, spike_step=args.steps * 3 // 4 - 6)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run.jsonl"
        sink = JSONLSink(run)
        for record in records:
            sink(record)
        sink.close()
        path = plot_run(run, args.out, title=f"GPT-2-like, {len(names)} parameters (synthetic run)")
    print(f"wrote {path} ({path.stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main()
