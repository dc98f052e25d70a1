"""A small transformer language model trained with DDP on synthetic tokens.

The worked example of the jitckpt user contract (README, "The save_fn
contract"): everything that decides what minibatch i computes is captured as it
was at the *start* of minibatch i, so a JIT checkpoint taken anywhere in the
forward/backward/all-reduce of minibatch i (or at the start of i+1) redoes the
minibatch exactly:

* model, optimizer and LR-scheduler state (only the optimizer step changes them);
* the step counter, which is also the data position (batch i is a pure
  function of (seed, i, rank));
* the torch RNG state snapshot taken at the top of the loop (dropout consumes
  the RNG during forward, so the live state is already past the start).

save_fn does no collective and writes into the directory it is given.

With ``--resumable`` the same training uses ``jitckpt.resumable(...)``
instead (``train_resumable``): no save_fn, no restore code, no RNG snapshot;
``--loader-workers N`` reads the batches through a shuffling DataLoader.

Run under jitrun (see `make demo`), or plain torchrun / python: jitckpt then
does nothing.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import signal
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import jitckpt


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=dropout, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos[: x.shape[1]]
        return self.head(self.blocks(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True))


def batch(seed: int, step: int, rank: int, bs: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 7919 + rank)
    # a learnable synthetic language: next token = (a * token + b) mod vocab, with noise
    start = torch.randint(0, vocab, (bs, 1), generator=g)
    idx = torch.arange(seq + 1).unsqueeze(0)
    seqs = (start * 31 + idx * 17) % vocab
    noise = torch.rand(bs, seq + 1, generator=g) < 0.1
    seqs = torch.where(noise, torch.randint(0, vocab, (bs, seq + 1), generator=g), seqs)
    return seqs[:, :-1], seqs[:, 1:]


class Timing:
    """The wall-clock behaviour of a busy real job, for the hang detection's
    tests: per-minibatch jitter, a straggler, and one-rank delays (an
    evaluation, a user's own checkpoint, a first-minibatch compile, a data
    loader stall). None of it changes what is computed: the final state is
    that of a run without it."""

    KINDS = ("eval", "save", "compile", "loader")

    def __init__(self, args: argparse.Namespace, rank: int, model: nn.Module) -> None:
        self.sleep, self.jitter, self.rank, self.model = args.step_sleep, args.jitter, rank, model
        self.rng = random.Random(args.seed * 7919 + rank)  # not torch's RNG: the training's stays untouched
        self.factor = args.straggle[1] if args.straggle and args.straggle[0] == rank else 1.0
        self.delays = [d for d in args.delay if d["rank"] == rank]
        self.x = batch(args.seed, 0, rank, args.batch, args.seq, args.vocab)[0]
        for d in self.delays:
            if d["kind"] == "compile":  # inside the first forward, as torch.compile's work is
                self._compile = model.register_forward_pre_hook(lambda mod, inp, s=d["seconds"]: self._busy(s))

    @staticmethod
    def parse(text: str) -> dict:
        kv = dict(item.split("=", 1) for item in text.split(","))
        d = {"rank": int(kv["rank"]), "seconds": float(kv["seconds"]), "kind": kv["kind"]}
        if d["kind"] not in Timing.KINDS:
            raise argparse.ArgumentTypeError(f"--delay kind {d['kind']!r} not one of {Timing.KINDS}")
        d["every"] = int(kv.get("every", 0))
        d["step"] = int(kv.get("step", 0))
        d["until"] = kv.get("until")  # loader: the wait ends early once this file exists
        return d

    @staticmethod
    def straggler(text: str) -> tuple[int, float]:
        rank, factor = text.split("=")
        return int(rank), float(factor)

    def _due(self, d: dict, step: int) -> bool:
        return (step + 1) % d["every"] == 0 if d["every"] else step == d["step"]

    def _busy(self, seconds: float) -> None:
        self._compile.remove()
        end = time.monotonic() + seconds
        while time.monotonic() < end:  # Python-heavy CPU work, as a compiler's
            sum(i * i for i in range(2000))

    def before_forward(self, step: int) -> None:
        for d in self.delays:
            if d["kind"] == "loader" and self._due(d, step):
                end = time.monotonic() + d["seconds"]  # the main thread waits for a batch
                while time.monotonic() < end and not (d["until"] and os.path.exists(d["until"])):
                    time.sleep(min(0.05, max(0.0, end - time.monotonic())))

    def after_step(self, step: int) -> None:
        s = self.sleep * self.factor
        if s and self.jitter:
            s *= 1 + self.rng.uniform(-self.jitter, self.jitter)
        if s:
            time.sleep(s)
        for d in self.delays:
            if d["kind"] == "eval" and self._due(d, step):
                self._evaluate(d["seconds"])
            elif d["kind"] == "save" and self._due(d, step):
                end = time.monotonic() + d["seconds"]
                with tempfile.TemporaryDirectory() as tmp:  # the user's own checkpoint, on a slow disk
                    torch.save(self.model.state_dict(), os.path.join(tmp, "user.pt"))
                    time.sleep(max(0.0, end - time.monotonic()))

    def _evaluate(self, seconds: float) -> None:
        """Forward passes of the local model (no DDP: no collective), CPU busy."""
        end = time.monotonic() + seconds
        self.model.eval()
        with torch.no_grad():
            while time.monotonic() < end:
                self.model(self.x)
        self.model.train()


def finish(args: argparse.Namespace, rank: int, model: nn.Module, opt: torch.optim.Optimizer, trained: int,
           t0: float) -> None:
    """After the loop: the optional barrier, rank 0's final model+optimizer
    state (atomically), the end of the process group."""
    if args.final_barrier:
        dist.barrier()
    if rank == 0:
        print(f"[rank 0] trained {trained} steps in {time.time() - t0:.2f}s", flush=True)
        if args.out:
            tmp = args.out + ".tmp"
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp)
            os.replace(tmp, args.out)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (simulated compute)")
    ap.add_argument("--jitter", type=float, default=0.0, help="each step's --step-sleep varies by +- this fraction")
    ap.add_argument("--straggle", type=Timing.straggler, default=None, metavar="RANK=FACTOR",
                    help="this rank's --step-sleep is FACTOR times longer (a straggler)")
    ap.add_argument("--delay", type=Timing.parse, action="append", default=[],
                    metavar="rank=R,seconds=T,kind=K[,step=S|,every=N]",
                    help="rank R is slow for T seconds at step S (or after every N-th step): kind eval (an "
                         "evaluation after the step, CPU busy), save (its own checkpoint after the step, idle), "
                         "compile (inside its first forward, CPU busy), loader (a data stall before the forward)")
    ap.add_argument("--final-barrier", action="store_true", help="a dist.barrier() after the training loop")
    ap.add_argument("--save-sleep", type=float, default=0.0, help="extra seconds inside save_fn (a slow save)")
    ap.add_argument("--out", default=None, help="rank 0 writes final model+optimizer state here")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--ckpt-every", type=int, default=0,
                    help="periodic baseline: rank 0 saves to --ckpt-dir every N steps (0 = never)")
    ap.add_argument("--ckpt-dir", default=None)
    ap.add_argument("--resumable", action="store_true",
                    help="use jitckpt.resumable(...) (one call, no save_fn) instead of register(save_fn)")
    ap.add_argument("--loader-workers", type=int, default=None,
                    help="with --resumable: read batches through a shuffling DataLoader with this many workers "
                         "(epochs of --epoch-batches minibatches) instead of generating batch i from (seed, i)")
    ap.add_argument("--epoch-batches", type=int, default=5)
    ap.add_argument("--rank-drift", action="store_true",
                    help="tests: after every optimizer step each rank nudges one weight by a rank-dependent "
                         "amount, as replicas with nondeterministic kernels drift apart")
    ap.add_argument("--catch-stop", action="store_true",
                    help="with --resumable: the script's own SIGTERM/SIGINT handler stops the loop after the "
                         "current minibatch and the script returns, as HF Trainer and Lightning do on SIGTERM")
    ap.add_argument("--init-log", default=None,
                    help="append 'rank pid' to this file once the set-up ran (how often initialisation ran)")
    args = ap.parse_args()
    if args.loader_workers is not None and not args.resumable:
        ap.error("--loader-workers needs --resumable (the register path has no data-position code)")
    if args.catch_stop and not args.resumable:
        ap.error("--catch-stop needs --resumable (a save at the script's end needs the state of the next minibatch "
                 "start, which the register path's save_fn does not record)")

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    model = TinyLM(args.vocab, args.d_model, args.layers, 4, args.seq, dropout=0.1)
    # Restart-stable gradient bucketing. By default DDP all-reduces everything
    # in one bucket in the first iteration of every (re)start and re-buckets by
    # gradient-ready order afterwards; with 3+ ranks gloo's ring then sums some
    # elements in another order, so a resumed run drifts in the last bits.
    # find_unused_parameters=True keeps the initial layout for good (no
    # re-bucketing), making a resumed minibatch bit-identical (README, contract).
    ddp = DDP(model, find_unused_parameters=True)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    if args.init_log:
        with open(args.init_log, "a") as f:  # closed at once: a migrated process holds no fd on it
            f.write(f"{rank} {os.getpid()}\n")
    if args.resumable:
        train_resumable(args, rank, model, ddp, opt, sched)
        return
    cursor = {"step": 0, "rng": torch.get_rng_state()}

    def write_state(ckpt_dir: str, step: int) -> None:
        if args.save_sleep:
            time.sleep(args.save_sleep)
        torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
                    "step": step, "rng": cursor["rng"]}, os.path.join(ckpt_dir, "state.pt"))

    def save_fn(ckpt_dir: str) -> None:
        # checkpoint_step(): the minibatch this JIT save describes (cursor["step"] inside the loop,
        # and still right when the save is taken at a collective after the loop)
        write_state(ckpt_dir, jitckpt.checkpoint_step())

    jitckpt.register(save_fn)
    path = jitckpt.get_checkpoint_path()
    state_file = os.path.join(path, "state.pt") if path is not None else None
    periodic = os.path.join(args.ckpt_dir, "periodic.pt") if args.ckpt_dir else None
    if state_file is None and periodic is not None and os.path.exists(periodic):
        state_file = periodic
    start = 0
    if state_file is not None:
        # weights_only=True: a checkpoint is data, never code
        state = torch.load(state_file, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
        torch.set_rng_state(state["rng"])
        start = state["step"]
        print(f"[rank {rank}] resumed from {state_file} at step {start}", flush=True)

    timing = Timing(args, rank, model)
    t0 = time.time()
    for step in range(start, args.steps):
        cursor["step"], cursor["rng"] = step, torch.get_rng_state()
        x, y = batch(args.seed, step, rank, args.batch, args.seq, args.vocab)
        timing.before_forward(step)
        logits = ddp(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if args.rank_drift:
            with torch.no_grad():
                next(model.parameters()).view(-1)[0].add_(1e-6 * rank)
        sched.step()
        timing.after_step(step)
        if args.ckpt_every and rank == 0 and (step + 1) % args.ckpt_every == 0:
            # what users run today: a blocking torch.save every N steps, made atomic
            cursor["step"], cursor["rng"] = step + 1, torch.get_rng_state()
            os.makedirs(args.ckpt_dir, exist_ok=True)
            tmp = periodic + ".tmp"
            write_state(args.ckpt_dir, step + 1)
            os.replace(os.path.join(args.ckpt_dir, "state.pt"), tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, periodic)
            print(f"[rank 0] periodic checkpoint at step {step + 1}", flush=True)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"[rank 0] step {step:4d} loss {loss.item():.4f} ppl {math.exp(loss.item()):.1f}", flush=True)
    finish(args, rank, model, opt, args.steps - start, t0)


def catch_stop(rank: int) -> threading.Event:
    """The script's own SIGTERM/SIGINT handler (--catch-stop): sets the event the loop checks after
    each minibatch, as HF Trainer's and Lightning's handlers make the loop stop at a step boundary."""
    stop = threading.Event()

    def handler(signum, frame) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def train_resumable(args: argparse.Namespace, rank: int, model: nn.Module, ddp: DDP,
                    opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler) -> None:
    """The same training with the one call: no save_fn, no restore code, no
    RNG snapshot. jitckpt restores model, optimizer, scheduler and the
    counters in ``state`` here, and the RNG and the loader's position at the
    first resumed minibatch."""
    loader = None
    if args.loader_workers is not None:
        # A shuffling loader whose order comes from the global RNG (RandomSampler
        # without a generator): the hardest case for an exact mid-epoch resume.
        n = args.epoch_batches * args.batch
        xs, ys = zip(*(batch(args.seed + 1, i, rank, 1, args.seq, args.vocab) for i in range(n)), strict=True)
        data = torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys))
        loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=True,
                                             num_workers=args.loader_workers)
    state = jitckpt.resumable(model=ddp, optimizer=opt, scheduler=sched, dataloader=loader,
                              state={"epoch": 0, "step": 0})
    start = state["step"]

    def train_step(step: int, x: torch.Tensor, y: torch.Tensor) -> None:
        logits = ddp(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        state["step"] = step + 1  # counters are read at the next minibatch's start
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"[rank 0] step {step:4d} loss {loss.item():.4f} ppl {math.exp(loss.item()):.1f}", flush=True)

    stop = catch_stop(rank) if args.catch_stop else None
    t0 = time.time()
    if loader is None:
        for step in range(start, args.steps):
            train_step(step, *batch(args.seed, step, rank, args.batch, args.seq, args.vocab))
            if stop and stop.is_set():
                print(f"[rank {rank}] stop signal: leaving after minibatch {step}", flush=True)
                break
    else:
        epoch = state["epoch"]
        while state["step"] < args.steps:
            state["epoch"] = epoch
            for x, y in loader:
                if state["step"] >= args.steps:
                    break
                train_step(state["step"], x, y)
            epoch += 1
    finish(args, rank, model, opt, args.steps - start, t0)


if __name__ == "__main__":
    main()
