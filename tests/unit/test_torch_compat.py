"""trainer.distributed.torch_compat: a torch that lacks a private API rekindle needs fails with one clear error
naming the API, this torch's version and the tested ones; nothing else imports private torch modules."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from trainer.distributed import torch_compat
from trainer.distributed.torch_compat import TorchVersionError

REPO = Path(__file__).resolve().parents[2]


def test_a_missing_private_api_names_itself_and_the_torch_version():
    with pytest.raises(TorchVersionError) as e:
        torch_compat._private("torch.distributed.checkpoint.filesystem", "_NoSuchThing")
    message = str(e.value)
    assert "torch.distributed.checkpoint.filesystem._NoSuchThing" in message
    assert torch.__version__ in message and torch_compat.TESTED in message


def test_the_public_home_is_preferred_and_the_private_one_is_the_fallback():
    found = torch_compat._first(("torch.distributed.checkpoint.no_such_module", "FsspecWriter"),
                                ("torch.distributed.checkpoint.filesystem", "FileSystemWriter"))
    assert found is torch.distributed.checkpoint.FileSystemWriter
    with pytest.raises(TorchVersionError, match=r"a\.b or c\.d"):
        torch_compat._first(("a", "b"), ("c", "d"))


def test_an_elastic_agent_without_the_overridden_members_is_refused():
    class Bare:
        _pcontext = None

    with pytest.raises(TorchVersionError, match="_start_workers") as e:
        torch_compat.check_elastic_agent(Bare())
    assert "_pcontext" not in str(e.value)


def test_no_other_module_imports_private_torch_apis():
    private = re.compile(r"(from|import)\s+torch[\w.]*\._\w+|\bimport\s+_\w+|torch\.distributed\._")
    offenders = []
    for folder in ("trainer", "data", "launch", "scripts"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path.name == "torch_compat.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if "torch" in line and private.search(line):
                    offenders.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
