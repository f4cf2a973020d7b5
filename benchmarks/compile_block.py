"""One bench-GPT block, eager against compiled, in one process with no sharding and no collectives.

    OMP_NUM_THREADS=1 python benchmarks/compile_block.py [--d-model 128 --seq 64 --batch 4 --rounds 15]

What compiling costs or saves with no runtime around it: the floor that ``shard(..., compile=True)``
(one compiled block per unit) can reach on this machine. Four ways, forward + backward each:

- ``plain``: the block's own parameters (leaves), eager and with its forward compiled as ``shard``
  compiles it (``torch.compile(block.forward)``);
- ``views``: the parameters replaced before every step by new views of one flat leaf (one ``split``,
  one ``view`` per parameter, installed in the modules' parameter tables), as the runtime installs
  its gathered views, eager and compiled; the gradient lands in the flat leaf.

The four run interleaved in rounds (the order rotated each round), 3 steps each per round; the
median of each is printed with its ratio to eager ``plain``, and the first compiled steps. Then a
``no_grad`` forward, eager and compiled. docs/performance.md, "Compiled".
"""

from __future__ import annotations

import argparse
import time

import torch

from hybridshard.bench.model import Block, add_shape_arguments


class _Views:
    """The block's parameters as views of one flat leaf, made anew before each step."""

    def __init__(self, block: Block) -> None:
        self.slots = [(m, n, p.shape) for m in block.modules() for n, p in list(m._parameters.items()) if p is not None]
        self.flat = torch.cat([p.detach().reshape(-1) for m, n, _ in self.slots for p in [m._parameters[n]]])
        self.flat.requires_grad_(True)
        self.sizes = [s.numel() for _, _, s in self.slots]

    def install(self) -> None:
        for (m, n, shape), piece in zip(self.slots, self.flat.split(self.sizes)):
            m._parameters[n] = piece.view(shape)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(p, layers=None, batch=4)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--backend", default="inductor")
    args = p.parse_args()
    x = torch.randn(args.batch, args.seq, args.d_model, requires_grad=True)

    def make(views: bool, compiled: bool):
        torch.manual_seed(0)
        block = Block(args.d_model, args.heads)
        flat = _Views(block) if views else None
        if compiled:
            block.forward = torch.compile(block.forward, backend=args.backend)

        def step() -> None:
            if flat is not None:
                flat.install()
                flat.flat.grad = None
            else:
                block.zero_grad(set_to_none=True)
            block(x).sum().backward()

        return block, step

    ways = {name: make(views, compiled) for name, views, compiled in (
        ("eager plain", False, False), ("compiled plain", False, True),
        ("eager views", True, False), ("compiled views", True, True))}
    first = {}
    for name, (_, step) in ways.items():
        t0 = time.perf_counter()
        step()
        first[name] = time.perf_counter() - t0
        step()
    times: dict[str, list[float]] = {n: [] for n in ways}
    names = list(ways)
    for r in range(args.rounds):
        for name in names[r % 4:] + names[:r % 4]:
            for _ in range(3):
                t0 = time.perf_counter()
                ways[name][1]()
                times[name].append((time.perf_counter() - t0) * 1e3)
    med = {n: sorted(v)[len(v) // 2] for n, v in times.items()}
    print(f"block d_model {args.d_model}, seq {args.seq}, batch {args.batch}, {torch.get_num_threads()} thread(s), "
          f"torch {torch.__version__}, backend {args.backend}; forward+backward, median of {3 * args.rounds} "
          "interleaved steps:")
    for n in names:
        print(f"  {n:<15} {med[n]:7.2f} ms  {med[n] / med['eager plain']:5.2f}x eager plain   first step "
              f"{first[n]:.1f} s")
    fwd = {}
    for name in ("eager plain", "compiled plain"):
        block = ways[name][0]
        with torch.no_grad():
            for _ in range(3):
                block(x)
            t = []
            for _ in range(30):
                t0 = time.perf_counter()
                block(x)
                t.append((time.perf_counter() - t0) * 1e3)
        fwd[name] = sorted(t)[15]
    print(f"  no_grad forward: eager {fwd['eager plain']:.2f} ms, compiled {fwd['compiled plain']:.2f} ms "
          f"({fwd['compiled plain'] / fwd['eager plain']:.2f}x)")


if __name__ == "__main__":
    main()
