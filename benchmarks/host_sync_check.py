"""Host syncs on the device, per phase, against the emulator's count for the same configurations.

Runs the steady-state steps (from the second one on) of the CUDA job's variants (``benchmarks/tiny_lm.py``) on one rank
and counts every host sync the runtime makes, by phase, two ways:

- on CUDA, under ``torch.cuda.set_sync_debug_mode("warn")``: every synchronizing CUDA call warns, and
  each warning is attributed to the phase the runtime was in (``hybridshard.runtime.trace.position``) and to
  the Python frame that made it, hybridshard's own code (or a documented exempt caller, see
  [Note: counting host syncs] in :mod:`hybridshard.runtime.trace.host_syncs`) or elsewhere;
- on the emulated device (``executor="emulate"``, CPU, gloo), by its wrapped syncing calls.

The two must agree. Not covered on the device: the debug mode sees the CUDA runtime's synchronizing
calls only, so torch.distributed's own operations (NCCL's ``wait()``, a gloo collective over CUDA
tensors, which copies through the host) are not counted; the step loop here makes no sync of its own.

    python benchmarks/host_sync_check.py                 # CUDA and the emulator (on CPU)
    python benchmarks/host_sync_check.py --device emulate --json counts.json

Without a CUDA device (and without ``--device emulate``) it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import warnings
from dataclasses import replace

import torch
import torch.distributed as dist

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after an installed hybridshard

import hybridshard as hs  # noqa: E402
from hybridshard.runtime.trace import host_syncs  # noqa: E402
from hybridshard.runtime.trace.position import current_where  # noqa: E402
from benchmarks import tiny_lm as RM  # noqa: E402

CONFIGS = {
    "hybrid fp32": ("HYBRID_SHARD", "fp32"),
    "full ckpt": ("FULL_SHARD", "ckpt"),
    "hybrid fp16 scaler": ("HYBRID_SHARD", "fp16"),
    "zero2 offload clip": ("HYBRID_SHARD_ZERO2", "offload"),
}
STEPS = 4
_PACKAGE = os.path.dirname(os.path.abspath(hs.__file__)) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_EXEMPT = (os.path.join("runtime", "grad_norm.py"), os.path.join("runtime", "offload.py"))  # host_syncs.EXEMPT's
# (fault-tolerant mode's two, host_syncs.EXEMPT_SITES, are made in torchft's own frames: "other" here)
_GRAD_SCALER = os.path.join("amp", "grad_scaler.py")


def classify(frame) -> tuple[str, str]:  # noqa: ANN001 - a frame object
    """``(kind, "file:line")`` for a sync warned about in ``frame``: the emulator's names for who made it.

    The innermost frame that is hybridshard's ("hot", or "exempt" for clip_grad_norm_ and offload's
    wait for the gradients' copies), torch's
    ``GradScaler`` ("exempt"), or else the first one outside torch ("other"); torch's own Python
    frames in between (``Event.synchronize``'s wrapper) are skipped, as the emulator counts the call
    hybridshard made. Frames of the warnings machinery are skipped too.
    """
    while frame is not None:
        name = frame.f_code.co_filename
        where = f"{os.path.relpath(name)}:{frame.f_lineno}"
        if name.startswith(_PACKAGE):
            return ("exempt" if name.endswith(_EXEMPT) else "hot"), where
        if name.endswith(_GRAD_SCALER):
            return "exempt", where
        if not name.startswith(_TORCH) and name != warnings.__file__ and name != __file__:
            return "other", where
        frame = frame.f_back
    return "other", "?"


class DeviceSyncs:
    """Sync-debug warnings by ``(kind, phase)`` (kind: see :func:`classify`) and by site."""

    def __init__(self) -> None:
        self.by_phase: collections.Counter[tuple[str, str]] = collections.Counter()
        self.sites: collections.Counter[str] = collections.Counter()

    def __enter__(self) -> "DeviceSyncs":
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self.show
        torch.cuda.set_sync_debug_mode("warn")

        # The debug mode does not flag cudaEventSynchronize: an event the host waits on is counted here.
        self._event_sync = torch.cuda.Event.synchronize
        counter = self

        def synchronize(event: torch.cuda.Event) -> None:
            counter.count(sys._getframe(1))
            return counter._event_sync(event)

        torch.cuda.Event.synchronize = synchronize
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.Event.synchronize = self._event_sync
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)

    def show(self, message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
        """``warnings.showwarning``: counts the sync-debug warnings, drops the others."""
        if "synchronizing" not in str(message):
            return
        self.count(sys._getframe(1))

    def count(self, frame) -> None:  # noqa: ANN001 - a frame object
        kind, where = classify(frame)
        self.by_phase[(kind, current_where().phase)] += 1
        self.sites[f"{kind} {where}"] += 1


def run(name: str, device: torch.device, groups: hs.ShardGroups) -> dict:
    strategy, variant = CONFIGS[name]
    cfg = replace(RM.variant_config(strategy, variant), steps=STEPS)
    emulated = device.type == "cpu"
    model = RM.sharded_model(cfg, groups, device, executor="emulate" if emulated else "streams")
    opt = RM.make_optimizer(cfg, model.parameters())
    scaler = hs.ShardedGradScaler(device.type, init_scale=2.0**10) if cfg.fp16 else None
    tokens = [RM.batch(step, 0, 0, cfg.micro_batch).to(device) for step in range(STEPS)]
    counted = host_syncs.counts()
    dev = DeviceSyncs()
    losses = []
    for step in range(STEPS):
        if step == 1:  # the steady state: from the second step on
            counted.reset()
            if not emulated:
                torch.cuda.synchronize(device)
                dev.__enter__()
        opt.zero_grad(set_to_none=True)
        loss = RM.lm_loss(model(tokens[step]), tokens[step])
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if cfg.clip is not None:
            hs.clip_grad_norm_(model, cfg.clip)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        losses.append(loss.detach())
    if not emulated:
        dev.__exit__(None, None, None)
        hot = {p: n for (k, p), n in dev.by_phase.items() if k == "hot"}
        exempt = {p: n for (k, p), n in dev.by_phase.items() if k == "exempt"}
        other = {p: n for (k, p), n in dev.by_phase.items() if k == "other"}
        sites = dict(dev.sites)
    else:
        hot, exempt, other = _by_phase(counted.hot), _by_phase(counted.exempt), {}
        sites = {f"hot {s}": n for (_, _, s), n in counted.hot.items()}
    return {"hot": hot, "exempt": exempt, "other": other, "sites": sites,
            "loss": float(torch.stack(losses).float().sum())}


def _by_phase(counter: dict) -> dict[str, int]:
    out: collections.Counter[str] = collections.Counter()
    for (_, phase, _), n in counter.items():
        out[phase] += n
    return dict(out)


def measure(device_kind: str) -> dict[str, dict]:
    """Every configuration on one rank: ``"cuda"`` (NCCL) or ``"emulate"`` (gloo, the emulated device)."""
    if device_kind == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    else:
        device = torch.device("cpu")
        host_syncs.install()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        groups = hs.init_groups()
        return {name: run(name, device, groups) for name in CONFIGS}
    finally:
        dist.destroy_process_group()


def emulated_in_subprocess() -> dict[str, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "emulated.json")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--device", "emulate", "--json", out],
                       check=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        with open(out) as f:
            return json.load(f)


def _fmt(counts: dict[str, int]) -> str:
    return "{" + ", ".join(f"{p} {n}" for p, n in sorted(counts.items())) + "}" if counts else "{}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["both", "emulate"], default="both")
    p.add_argument("--json", help="write the counts here")
    args = p.parse_args()
    if args.device == "emulate":
        got = measure("emulate")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(got, f)
        for name, c in got.items():
            print(f"figures: {name}: emulator hot {_fmt(c['hot'])}, exempt {_fmt(c['exempt'])}")
        return 0
    if not torch.cuda.is_available():
        print("host_sync_check: skipped: no CUDA device on this machine")
        return 0
    emulated = emulated_in_subprocess()
    device = measure("cuda")
    agree, parts, exempt = 0, [], []
    for name in CONFIGS:
        d, e = device[name], emulated[name]
        # [Note: what must agree] The hot path's syncs, by phase. Exempt ones (clip_grad_norm_, the
        # scaler, offload's one wait) are allowed by design and each instrument sees some the other
        # cannot: on one host the emulator has no device crossing in a clip over CPU-offloaded
        # gradients; they are printed side by side.
        same = d["hot"] == e["hot"]
        agree += same
        print(f"  {name}: device hot {_fmt(d['hot'])} exempt {_fmt(d['exempt'])} elsewhere {_fmt(d['other'])} | "
              f"emulator hot {_fmt(e['hot'])} exempt {_fmt(e['exempt'])} | {'agree' if same else 'DIFFER'}")
        for site, n in sorted(d["sites"].items()):
            print(f"    device {site}: {n}")
        parts.append(f"{name} {sum(d['hot'].values())}/{sum(e['hot'].values())}")
        exempt.append(f"{name} {sum(d['exempt'].values())}/{sum(e['exempt'].values())}")
    print(f"figures: steady-state hot-path syncs device/emulator per config: {', '.join(parts)}; "
          f"{agree}/{len(CONFIGS)} configs agree by phase; exempt device/emulator {', '.join(exempt)} "
          f"(torch.distributed's own ops not covered by sync debug mode)")
    return 0 if agree == len(CONFIGS) else 1


if __name__ == "__main__":
    sys.exit(main())
