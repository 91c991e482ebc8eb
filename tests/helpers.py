"""Helpers shared by the tests (fixtures are in conftest.py; the loopback S3 server, the TCP proxy and
process-tree kills in fixtures.py): paths, bounded waits (`wait_for`); running the real trainer as
separate processes (plain python, or torchrun with several gloo ranks) and reading its metrics; the
elastic launcher in separate processes (`launch`, `finish`) and waits on its ledger events and its
ranks' heartbeats; a child environment whose S3 endpoint is unreachable; small trained models and
checkpoint helpers; the data tests' documents and dataset."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tests import fixtures
from tests.fixtures import free_port
from trainer.distributed.parallel import DistInfo
from trainer.model.transformer import ModelArgs, Transformer
from trainer.runtime.protocol import HeartbeatRecord, read_events, read_heartbeats

if TYPE_CHECKING:
    from data.shards import ShardSet

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "configs" / "smoke.yaml"


def wait_for(what: str, check, timeout: float, every: float = 0.1, explain=None) -> float:
    """Poll `check` every `every` seconds until it holds; the seconds it took (AssertionError naming `what`
    after `timeout`, followed by what `explain()` returns, when given: logs, events)."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start >= timeout:
            raise AssertionError(f"no {what} within {timeout:.0f}s" + (f"\n{explain()}" if explain else ""))
        time.sleep(every)
    return time.monotonic() - start


# --- the trainer in separate processes ------------------------------------------------------------


# The MFU peak, named rather than measured: measuring it keeps every core busy for about half a second
# at each start of a rank, and a unit test covers the measurement (test_observability). A test's own
# log.peak_tflops comes later and wins.
KNOWN_PEAK = "log.peak_tflops=0.15"


def trainer_cmd(nproc: int, config: Path, overrides: list[str]) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "trainer", str(config), KNOWN_PEAK, *overrides]
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--max-restarts=0",
        "-m", "trainer", str(config), KNOWN_PEAK, *overrides,
    ]


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    env.update(extra)
    return env


def run_trainer(
    run_dir: Path, overrides: list[str] = (), nproc: int = 1, timeout: float = 180, config: Path = SMOKE,
    check: bool = True, env: dict | None = None,
) -> subprocess.CompletedProcess:
    """Run the trainer to completion in fresh processes (bounded by `timeout`; `env`: added variables)."""
    args = [f"run.dir={run_dir}", "log.progress=false", *overrides]
    proc = subprocess.run(
        trainer_cmd(nproc, config, args), cwd=REPO, env=child_env(**(env or {})), capture_output=True, text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"trainer exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def read_metrics(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl by step; a step logged twice (before a crash and after resume) keeps the last."""
    records: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        records[r["step"]] = r
    return records


# --- the elastic launcher in separate processes (python -m launch) ---------------------------------

# Heartbeats and restarts fast enough for tests; the known MFU peak (KNOWN_PEAK).
FAST = ["log.progress=false", "train.log_every=1", "train.eval_every=0", "fault.heartbeat_s=0.2",
        "fault.restart_backoff_s=0.2", KNOWN_PEAK]


def launch(run_dir: Path, overrides: list[str] = (), nproc: int = 2, extra_args: list[str] = (),
           env: dict | None = None) -> subprocess.Popen:
    """Start `python -m launch` on the smoke config in a session of its own (output: stdout, text)."""
    cmd = [sys.executable, "-m", "launch", f"--nproc-per-node={nproc}", *extra_args, str(SMOKE),
           f"run.dir={run_dir}", *FAST, *overrides]
    return subprocess.Popen(cmd, cwd=REPO, env=child_env(**(env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 150) -> str:
    """The launcher's output once it has ended (bounded: SIGKILL to its session, and fail, after `timeout`)."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"launcher did not finish within {timeout}s:\n{out[-4000:]}") from None
    return out


def wait_for_step(run_dir: Path, step: int, timeout: float = 90, rank: int = 0, attempt: int | None = None,
                  phases: tuple[str, ...] = ("train",), poll_s: float = 0.05) -> HeartbeatRecord:
    """The heartbeat record of `rank` once it has finished `step` (bounded wait), in `attempt` if given,
    in one of `phases` (an eval every step leaves a rank in `train` only briefly)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for directory in run_dir.glob("heartbeats-*"):
            beat = read_heartbeats(directory).get(rank)
            if beat and beat.step >= step and beat.phase in phases and attempt in (None, beat.attempt):
                return beat
        time.sleep(poll_s)
    raise AssertionError(f"rank {rank} did not reach step {step} within {timeout}s")


def wait_for_event(run_dir: Path, event: str, timeout: float = 60, count: int = 1, where=None,
                   launchers: list[subprocess.Popen] = ()) -> list[dict]:
    """The ledger's `event` records (those for which `where(record)` holds, if given) once there are
    `count` of them (bounded wait); fails at once when one of `launchers` has ended before."""
    found: list[dict] = []

    def enough() -> bool:
        ended = [p.pid for p in launchers if p.poll() is not None]
        assert not ended, f"launcher(s) {ended} ended before {count} {event!r} event(s): {read_events(run_dir)[-3:]}"
        found[:] = [e for e in read_events(run_dir) if e["event"] == event and (where is None or where(e))]
        return len(found) >= count

    wait_for(f"{count} {event!r} event(s) in {run_dir}/events.jsonl", enough, timeout, every=0.05)
    return found


def launcher_beats(run_dir: Path, launcher_pid: int) -> list[HeartbeatRecord]:
    """The heartbeat records of the ranks a launcher runs now (its heartbeat directory's)."""
    return [b for d in run_dir.glob(f"heartbeats-*{launcher_pid}-*") for b in read_heartbeats(d).values()]


def node_beat(run_dir: Path, launcher_pid: int) -> HeartbeatRecord | None:
    """The newest heartbeat of the ranks a launcher ran (one at a time here; None before the first)."""
    return max(launcher_beats(run_dir, launcher_pid), key=lambda b: b.startup.t_proc, default=None)


def wait_for_one_group(run_dir: Path, launchers: list[subprocess.Popen], step: int,
                       timeout: float = 120) -> list[HeartbeatRecord]:
    """The launchers' ranks' newest heartbeats (one rank each) once they all train in one worker group (the
    same rendezvous round), each past `step`. A launcher slow to start on a busy machine misses the first
    round's last call and joins the next: waiting for a step alone would not see that."""
    deadline, beats = time.time() + timeout, []
    while len(beats) < len(launchers) or len({b.group for b in beats}) > 1 or min(b.step for b in beats) < step:
        assert time.time() < deadline and all(p.poll() is None for p in launchers), beats
        time.sleep(0.05)
        beats = [b for p in launchers if (b := node_beat(run_dir, p.pid)) is not None]
    return beats


# --- the trainer in this process (the speed-option tests) ----------------------------------------

SHORT = ["train.steps=4", "train.log_every=1", "train.eval_every=0", "checkpoint.every=0", "train.warmup_steps=2"]


def train_here(run_dir: Path, overrides: list[str]) -> list[float]:
    """Run the trainer in this process; returns the loss of every step."""
    from trainer.config import load
    from trainer.loop import train

    train(load(SMOKE, [f"run.dir={run_dir}", "log.progress=false", KNOWN_PEAK, *overrides]))
    return [r["loss"] for _, r in sorted(read_metrics(run_dir).items())]


# --- object storage that cannot be reached --------------------------------------------------------

SECRET = "s3cr3t-never-printed"  # the secret key in unreachable_env: no output may contain it


def unreachable_env() -> dict[str, str]:
    """A child environment whose S3 endpoint nobody listens on (a closed loopback port), with dummy
    credentials and no retries, so that a client fails at once."""
    return fixtures.unreachable_env(child_env(), secret=SECRET)


# --- models and checkpoints ------------------------------------------------------------------------

SOLO = DistInfo(rank=0, world=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


def trained(seed: int = 0) -> tuple[Transformer, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, seq_len=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        x = torch.randint(0, 64, (2, 17))
        torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def smoke_model() -> tuple[Transformer, torch.optim.AdamW]:
    from trainer.config import load
    from trainer.optim import build_optimizer

    cfg = load(SMOKE)
    model = Transformer(cfg.model)
    return model, build_optimizer(model, cfg, torch.device("cpu"))


def assert_same(a: tuple, b: tuple) -> None:
    for (n, p), q in zip(a[0].state_dict().items(), b[0].state_dict().values(), strict=True):
        assert torch.equal(p, q), n
    sa, sb = a[1].state_dict()["state"], b[1].state_dict()["state"]
    for k in sa:
        for key in sa[k]:
            assert torch.equal(sa[k][key], sb[k][key]), (k, key)


def assert_params_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = dict(a.named_parameters(remove_duplicate=False)), dict(b.named_parameters(remove_duplicate=False))
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def load_final(run_dir: Path) -> dict[str, torch.Tensor]:
    """The newest committed checkpoint's model parameters (and its step), loaded on one process (resharded)."""
    from trainer.checkpoint import Checkpointer

    model, opt = smoke_model()
    ckpt = Checkpointer(str(run_dir / "checkpoints"), SOLO)
    state = ckpt.load(ckpt.discover_latest(), model, opt)
    return {"step": state.step, **{k: v.clone() for k, v in model.state_dict().items()}}


def corrupted(data: bytes, how: str) -> bytes:
    """`data` with one bit flipped in the middle ("flip") or its last 5 bytes cut off ("truncate")."""
    if how == "flip":
        flipped = bytearray(data)
        flipped[len(flipped) // 2] ^= 0x10
        return bytes(flipped)
    if how == "truncate":
        return data[:-5]
    raise ValueError(f"unknown corruption {how!r}")


def corrupt(path: Path, how: str) -> None:
    """Flip a bit in or truncate the local file (see `corrupted`); any other `how` deletes it."""
    if how in ("flip", "truncate"):
        path.write_bytes(corrupted(path.read_bytes(), how))
    else:
        path.unlink()


def corrupt_on_s3(url: str, how: str) -> None:
    """`corrupt` for an object on the loopback S3 server (flip or truncate)."""
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.pipe_file(url, corrupted(fs.cat_file(url), how))


# The checkpoint round trips, run on local disk (tests/unit) and on the loopback S3 server
# (tests/integration).


def check_round_trip_is_bit_exact(root: str) -> None:
    from trainer.checkpoint import Checkpointer, TrainState

    saved = trained(0)
    ckpt = Checkpointer(root, SOLO)
    ckpt.save(TrainState(step=7, tokens_seen=70, data={"samples_consumed": 14}), *saved)
    fresh = trained(1)
    assert ckpt.discover_latest() == 7
    state = ckpt.load(7, *fresh)
    assert (state.step, state.tokens_seen, state.data) == (7, 70, {"samples_consumed": 14})
    assert_same(saved, fresh)


def odd_tensors() -> dict:
    """Every dtype a checkpoint may hold, and tensors that are views: a slice with a storage offset, a
    non-contiguous column slice and transpose, a scalar, an empty tensor; plus a non-tensor item."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    return {
        "f32": torch.randn(5, 3, generator=g), "bf16": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "f16": torch.randn(4, generator=g).half(), "f64": torch.randn(2, 2, generator=g).double(),
        "i64": torch.randint(-2**62, 2**62, (9,), generator=g), "i32": torch.randint(-9, 9, (3, 3), generator=g).int(),
        "u8": torch.randint(0, 255, (11,), generator=g, dtype=torch.uint8), "bool": torch.rand(13, generator=g) > 0.5,
        "c64": torch.randn(3, generator=g, dtype=torch.complex64),
        "rows": base[2:5], "cols": base[:, 1:4], "t": base.t(), "scalar": torch.tensor(3.5), "empty": torch.empty(0, 4),
        "step": 12, "note": {"lr": 0.1, "betas": (0.9, 0.95)},
    }


def blank(sd: dict) -> dict:
    """The same structure: tensors zeroed, other values None."""
    return {k: blank(v) if isinstance(v, dict) else torch.zeros_like(v) if torch.is_tensor(v) else None
            for k, v in sd.items()}


def check_raw_format_round_trip_is_bit_exact(path: str) -> None:
    import torch.distributed.checkpoint as dcp

    from common import storage
    from trainer.checkpoint.format import RAW_FORMAT, load_metadata, load_state
    from trainer.checkpoint.writing import writer

    sd = odd_tensors()
    w = writer(path)
    dcp.save(sd, storage_writer=w, no_dist=True)
    fs, p = storage.filesystem(path)
    meta = load_metadata(fs.cat_file(f"{p}/.metadata"))
    formats = {k.fqn: v.transform_descriptors for k, v in meta.storage_data.items()}
    assert {k for k, f in formats.items() if f == (RAW_FORMAT,)} == {k for k, v in sd.items() if torch.is_tensor(v)}
    assert formats["step"] is None and formats["note.lr"] is None  # objects: torch.save'd, as DCP does
    assert set(w.digests) == {"__0_0.distcp", ".metadata"}
    for name, info in w.digests.items():  # hashed as written == hashed as stored
        assert info[storage.CHECKSUM] == storage.checksum_file(fs, f"{p}/{name}"), name
    got = blank(sd)
    load_state(got, path)
    for k, v in sd.items():
        if torch.is_tensor(v):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


# --- data ------------------------------------------------------------------------------------------

TEXTS = [f"def function_{i}(x):\n    return x * {i} + {i % 7}  # number {i}\n" * (1 + i % 5) for i in range(300)]


def make_dataset(out) -> ShardSet:
    """TEXTS prepared into small shards (2,000 tokens) so that reads cross shard boundaries."""
    from data import tokenizer as tokenizers_
    from data.prepare import prepare
    from data.shards import ShardSet

    tok = tokenizers_.train(TEXTS, vocab_size=300)
    prepare(TEXTS, str(out), tok, shard_tokens=2000, progress=False)
    return ShardSet(str(out))


def upload(local: ShardSet, url: str) -> str:
    """Copy a local dataset's files to `url` (file by file: plain PUTs)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    for f in sorted(Path(local.root).iterdir()):
        fs.pipe_file(f"{path}/{f.name}", f.read_bytes())
    return url


# --- W&B offline runs -------------------------------------------------------------------------------


def wandb_offline_env(tmp: Path) -> dict[str, str]:
    """Environment for wandb offline: no network (no error reports either), no console capture, nothing
    written outside `tmp`."""
    return {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_ERROR_REPORTING": "false",
            "WANDB_CONSOLE": "off", "WANDB_DIR": str(tmp), "WANDB_CONFIG_DIR": str(tmp / "wandb-config"),
            "WANDB_CACHE_DIR": str(tmp / "wandb-cache"), "WANDB_DATA_DIR": str(tmp / "wandb-data")}


def wandb_offline_runs(run_dir: Path) -> list[tuple[str, list[tuple[int, dict]]]]:
    """Each offline W&B run under run_dir/wandb/, in the order they started: (run id, history rows (step,
    {key: value}), `_`-keys left out). Read from the run's transaction log `run-ID.wandb` (wandb 0.31 has no reader of
    its own): a 7-byte header (`:W&B`, magic, version), then LevelDB's log format: 32 KiB blocks of
    chunks, each a 7-byte header (CRC32C, length, type: 1 full, 2 first, 3 middle, 4 last) and a piece of
    a serialized protobuf `Record`; a block's last < 7 bytes are padding."""
    import struct

    from wandb.proto import wandb_internal_pb2

    runs = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        data, pos, record, run, rows = path.read_bytes(), 7, b"", None, []
        assert data[:4] == b":W&B", path
        while pos + 7 <= len(data):
            if (left := 32768 - pos % 32768) < 7:
                pos += left
                continue
            _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
            record = chunk if kind in (1, 2) else record + chunk
            if kind not in (1, 4):
                continue
            r = wandb_internal_pb2.Record.FromString(record)
            if r.HasField("run"):
                run = r.run
            elif r.HasField("history"):
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
                rows.append((r.history.step.num, {k: v for k, v in items.items() if not k.startswith("_")}))
        # The run record can be missing from a file wandb has not flushed it to: then the id is the file's
        # name, and its last write (the run's end) orders it: after the runs started before it ended.
        started = run.start_time.ToNanoseconds() if run else path.stat().st_mtime_ns
        runs.append((started, run.run_id if run else path.stem.removeprefix("run-"), rows))
    return [(run_id, rows) for _, run_id, rows in sorted(runs)]
