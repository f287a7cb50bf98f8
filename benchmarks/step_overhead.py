"""What a zero-copy batch's graph costs beyond its forward, per plan.

At 128 tokens on the H200 the two few-token plans' bare forwards tie, while
in the engine's zero-copy graph the small_linear plan takes 19-26 us more
than its forward and the preload_linear plan 6-13 (engine/cuda/tiles.py
names both). This bisects the difference. For BERT-base (random weights) at a few
small shapes and both plans, one CUDA graph each of:

- forward: FusedForward on device int64 ids and lengths, device output;
- step, device input: the engine's graph step on an int32 io buffer in
  device memory, device output;
- step, mapped input: the same on the pinned slot's mapped io buffer
  (``FusedForward.reads_host`` shapes read it in the embedding kernel),
  device output;
- step, zero-copy: mapped input and the mapped pinned output, the graph the
  engine replays.

All graphs of a shape are replayed in turn from an idle stream (fused's
``time_in_turn``: the median of rounds that replay each once), and each is
printed in microseconds with its ratio to the forward.

    python benchmarks/step_overhead.py [--rounds 50] [--out step_overhead_h200.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine import write_checkpoint  # noqa: E402
from engine.cuda.backend import MAX_ROWS, CudaBackend, ModelRunner  # noqa: E402
from engine.cuda.timing import captured, time_in_turn  # noqa: E402

SHAPES = [(1, 128), (8, 16), (1, 64), (1, 16)]
VARIANTS = ("forward", "step, device input", "step, mapped input", "step, zero-copy")
PLANS = {False: "SMALL_LINEAR", True: "PRELOAD_LINEAR"}


def calls(
    runner: ModelRunner, batch: int, length: int, seed: int
) -> dict[str, Callable[[], object]]:
    """Each variant's work for one shape, on the same random ids and lengths
    (written into the first slot's mapped io buffer, and copies of them)."""
    rng = np.random.default_rng(seed)
    tokens = batch * length
    values = np.empty(tokens + batch, dtype=np.int32)
    values[:tokens] = rng.integers(1000, runner.vocab, size=tokens, dtype=np.int32)
    values[tokens:] = length
    slot = runner.ring.slots[0]
    slot.io[: tokens + batch] = values
    device_io = torch.from_numpy(values).to(runner.device)
    ids = device_io[:tokens].view(batch, length).long()
    lengths = device_io[tokens:].long()
    mapped = slot.io_cuda[: tokens + batch]
    return {
        "forward": partial(runner.forward, ids, lengths),
        "step, device input": partial(runner.step, device_io, None, batch, length),
        "step, mapped input": partial(runner.step, mapped, None, batch, length),
        "step, zero-copy": partial(runner.step, mapped, slot.out_cuda, batch, length),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--out", type=Path, default=Path("step_overhead_gpu.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("step_overhead.py needs a CUDA GPU")
    backend = CudaBackend("cuda:0", input_mode="zero-copy")
    with tempfile.TemporaryDirectory() as tmp:
        entry = write_checkpoint("bert-base", Path(tmp) / "bert-base")
        backend.load(entry)
    runner = backend.runner("bert-base")
    runner.allocate(MAX_ROWS)
    forward = runner.forward
    rows: list[dict[str, Any]] = []
    print(f"{'shape':8} {'plan':15} " + " ".join(f"{v:>22}" for v in VARIANTS))
    with torch.inference_mode(), torch.cuda.stream(backend.stream):
        for batch, length in SHAPES:
            forward.choose_attention(batch, length)
            work = calls(runner, batch, length, seed=batch * 1000 + length)
            graphs = []
            for preload in PLANS:
                forward.preloaded[(batch, length)] = preload
                graphs += [captured(work[v]) for v in VARIANTS]
            times = time_in_turn(graphs, args.rounds)
            for index, plan in enumerate(PLANS.values()):
                us = [t * 1e3 for t in times[index * 4 : index * 4 + 4]]
                rows.append(
                    {"batch": batch, "length": length, "plan": plan}
                    | {v: round(t, 2) for v, t in zip(VARIANTS, us, strict=True)}
                )
                cells = " ".join(
                    f"{t:12.1f} us {t / us[0]:5.3f}x" for t in us
                )  # fmt: skip
                print(f"{batch}x{length:<6} {plan:15} {cells}", flush=True)
            runner.ring.slots[0].io[: batch * (length + 1)] = 0
    result = {
        "device": torch.cuda.get_device_name(0),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "rounds": args.rounds,
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
