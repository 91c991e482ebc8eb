"""trainer.recovery.grad_norm on 2 real gloo ranks with the smoke model under FSDP2: the norm and the
clipped gradients are torch's (clip_grad_norm_ through DTensor), clipping or not; a non-finite gradient
on one rank gives a non-finite norm on both, as torch's does; one process (plain tensors) agrees too."""

from __future__ import annotations

import json
import math
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.fixtures import free_port

WORLD = 2


def _fsdp_model(rank: int):
    from torch.distributed.fsdp import fully_shard

    from trainer.model.args import ModelArgs
    from trainer.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=64, seq_len=16))
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    torch.manual_seed(rank)
    tokens = torch.randint(0, 64, (2, 17))
    model(tokens[:, :-1], None, targets=tokens[:, 1:]).backward()
    return model


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.to_local().clone() for p in model.parameters()]


def _set_grads(model, grads: list[torch.Tensor]) -> None:
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad.to_local().copy_(g)


def _ranks(rank: int, port: int, out: str) -> None:
    from trainer.recovery.grad_norm import clip_grad_norm

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    results = {}
    model = _fsdp_model(rank)
    before = _grads(model)
    for name, max_norm in (("clips", 0.05), ("does not clip", 1e9), ("measures only", float("inf"))):
        _set_grads(model, before)
        norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_norm, foreach=True).full_tensor()
        theirs = _grads(model)
        _set_grads(model, before)
        mine_norm = clip_grad_norm(model.parameters(), max_norm)
        mine = _grads(model)
        results[name] = {
            "torch": float(norm), "mine": mine_norm,
            "grads_close": all(torch.allclose(a, b, rtol=1e-5, atol=1e-8) for a, b in zip(theirs, mine, strict=True)),
            "clipped": not all(torch.equal(a, b) for a, b in zip(before, mine, strict=True)),
        }
    _set_grads(model, before)
    if rank == 1:  # an overflowed gradient on one rank only
        next(model.parameters()).grad.to_local().view(-1)[0] = float("inf")
    results["non-finite"] = {"mine": clip_grad_norm(model.parameters(), 1.0)}
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def test_the_norm_and_clipped_gradients_are_torchs_on_fsdp2_shards(tmp_path):
    mp.start_processes(_ranks, args=(free_port(), str(tmp_path)), nprocs=WORLD, start_method="spawn", join=True)
    results = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(WORLD)]
    for case in ("clips", "does not clip", "measures only"):
        torch_norm, mine = results[0][case]["torch"], [r[case]["mine"] for r in results]
        assert mine[0] == mine[1], (case, mine)  # every rank the same norm
        assert math.isclose(mine[0], torch_norm, rel_tol=1e-6), (case, mine, torch_norm)
        assert all(r[case]["grads_close"] for r in results), case
        assert all(r[case]["clipped"] for r in results) == (case == "clips"), case
    assert all(not math.isfinite(r["non-finite"]["mine"]) for r in results), results


def test_one_process_agrees_with_torch():
    from trainer.recovery.grad_norm import clip_grad_norm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    model(torch.randn(4, 8)).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1))
    theirs = [p.grad.clone() for p in model.parameters()]
    for p, g in zip(model.parameters(), before, strict=True):
        p.grad.copy_(g)
    assert norm > 0.1 and math.isclose(clip_grad_norm(model.parameters(), 0.1), norm, rel_tol=1e-6)
    for p, g in zip(model.parameters(), theirs, strict=True):
        assert torch.allclose(p.grad, g, rtol=1e-6)
