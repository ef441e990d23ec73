"""Training checkpoints: exact resume (weights, optimizer, scheduler, RNG), pruning, fallback past
damaged checkpoints, leftovers of interrupted saves, and resume after real SIGKILLs."""

from __future__ import annotations

import json
import logging
import os
import random
import runpy
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from skillswarm.agent.model import (
    TEMPLATE_FIXED_STRINGS,
    build_tiny_model,
    build_tokenizer,
    load_policy,
)
from skillswarm.node import checkpointing
from skillswarm.node.checkpointing import (
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    TrainingState,
    latest_checkpoint,
    load_training_checkpoint,
    save_training_checkpoint,
    step_directory_name,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TEMPLATE_FIXED_STRINGS)


def tiny_model(tokenizer, seed: int = 0, hidden: int = 32):
    return build_tiny_model(tokenizer, seed=seed, hidden=hidden, layers=1, heads=2, intermediate=64)


def make_trainer(tokenizer, seed: int = 0):
    model = tiny_model(tokenizer, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + step))
    return model, optimizer, scheduler


def train_steps(model, optimizer, scheduler, vocab_size: int, steps: int) -> list[tuple]:
    """AdamW steps on token batches drawn from torch's global RNG; returns draws from every
    global RNG stream so a test can see they continue where they left off."""
    draws = []
    model.train()
    for _ in range(steps):
        input_ids = torch.randint(0, vocab_size, (4, 12))
        loss = model(input_ids=input_ids, labels=input_ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        draws.append((random.random(), float(np.random.rand()), float(torch.rand(()))))
    return draws


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def weights(model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def assert_same_weights(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert left.keys() == right.keys()
    for name in left:
        assert torch.equal(left[name], right[name]), name


def weights_without_tied(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors `save_pretrained` writes for the tiny model: the tied output head is dropped."""
    return {name: tensor for name, tensor in state_dict.items() if name != "lm_head.weight"}


def save_simple(directory: Path, tokenizer, step: int, keep: int = 5, seed: int | None = None):
    model, optimizer, _ = make_trainer(tokenizer, seed=step if seed is None else seed)
    state = TrainingState(step=step, data_position={"cursor": step * 10}, policy_version=step)
    return save_training_checkpoint(directory, model, optimizer, state, keep=keep), model


def test_resume_continues_bit_identically_to_an_uninterrupted_run(tmp_path: Path, tokenizer):
    vocab = len(tokenizer)
    seed_everything(0)
    model, optimizer, scheduler = make_trainer(tokenizer)
    train_steps(model, optimizer, scheduler, vocab, 2)
    state = TrainingState(
        step=1, data_position={"task_seed": 17, "epoch": 0}, policy_version=3, extra={"a": [1, 2]}
    )
    saved = save_training_checkpoint(
        tmp_path, model, optimizer, state, tokenizer=tokenizer, scheduler=scheduler
    )
    assert saved == tmp_path / "step-000001"
    expected_draws = train_steps(model, optimizer, scheduler, vocab, 2)
    expected_weights = weights(model)
    expected_optimizer = optimizer.state_dict()

    seed_everything(123)
    resumed_model, resumed_optimizer, resumed_scheduler = make_trainer(tokenizer, seed=5)
    restored = load_training_checkpoint(
        tmp_path, resumed_model, resumed_optimizer, resumed_scheduler
    )
    assert restored == state
    assert resumed_scheduler.last_epoch == 2
    resumed_draws = train_steps(resumed_model, resumed_optimizer, resumed_scheduler, vocab, 2)

    assert resumed_draws == expected_draws
    assert_same_weights(weights(resumed_model), expected_weights)
    resumed_state = resumed_optimizer.state_dict()["state"]
    for index, moments in expected_optimizer["state"].items():
        for key, value in moments.items():
            assert torch.equal(resumed_state[index][key], value), (index, key)


def test_checkpoint_folder_loads_as_a_hugging_face_model(tmp_path: Path, tokenizer):
    model, optimizer, _ = make_trainer(tokenizer)
    folder = save_training_checkpoint(
        tmp_path, model, optimizer, TrainingState(step=7), tokenizer=tokenizer
    )
    loaded, loaded_tokenizer = load_policy(folder)
    assert_same_weights(weights(loaded), weights(model))
    assert loaded_tokenizer.encode("<tool_call>12+3") == tokenizer.encode("<tool_call>12+3")


def test_without_rng_restore_leaves_the_streams_alone(tmp_path: Path, tokenizer):
    model, optimizer, _ = make_trainer(tokenizer)
    seed_everything(0)
    save_training_checkpoint(tmp_path, model, optimizer, TrainingState(step=0))
    seed_everything(9)
    expected = (random.random(), float(torch.rand(())))
    seed_everything(9)
    load_training_checkpoint(tmp_path, tiny_model(tokenizer, seed=1), restore_rng=False)
    assert (random.random(), float(torch.rand(()))) == expected


def test_plain_torch_module_round_trips(tmp_path: Path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    folder = save_training_checkpoint(tmp_path, model, optimizer, TrainingState(step=3))
    assert (folder / "model.safetensors").is_file()

    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    assert load_training_checkpoint(tmp_path, fresh, fresh_optimizer).step == 3
    assert_same_weights(weights(fresh), weights(model))
    momentum = fresh_optimizer.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(momentum, optimizer.state_dict()["state"][0]["momentum_buffer"])

    scheduler = torch.optim.lr_scheduler.StepLR(fresh_optimizer, step_size=1)
    with pytest.raises(IncompatibleCheckpointError, match="without a scheduler"):
        load_training_checkpoint(tmp_path, fresh, fresh_optimizer, scheduler)


def test_keep_prunes_older_checkpoints_and_latest_names_the_newest(tmp_path: Path, tokenizer):
    for step in range(5):
        save_simple(tmp_path, tokenizer, step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000003", "step-000004"]
    assert (tmp_path / "latest").read_text() == "step-000004\n"
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000004"


def test_saving_an_earlier_step_replaces_it_and_drops_the_abandoned_later_ones(
    tmp_path: Path, tokenizer
):
    for step in (1, 2, 3):
        save_simple(tmp_path, tokenizer, step, keep=3)
    _, replacement = save_simple(tmp_path, tokenizer, 2, keep=3, seed=42)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000001", "step-000002"]
    fresh = tiny_model(tokenizer, seed=7)
    assert load_training_checkpoint(tmp_path, fresh).step == 2
    assert_same_weights(weights(fresh), weights(replacement))


def _truncate(folder: Path) -> None:
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-64])


def _overwrite_header(folder: Path) -> None:
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[:16] = b"\xff" * 16
    path.write_bytes(bytes(data))


def _garble_state(folder: Path) -> None:
    (folder / "state.json").write_text('{"format": "skillswarm-training-checkpoint/1", "st')


def _garble_optimizer(folder: Path) -> None:
    path = folder / "optimizer.pt"
    path.write_bytes(b"\0" * path.stat().st_size)


@pytest.mark.parametrize("damage", [_truncate, _overwrite_header, _garble_state, _garble_optimizer])
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(
    tmp_path: Path, tokenizer, damage, caplog: pytest.LogCaptureFixture
):
    _, older = save_simple(tmp_path, tokenizer, 1)
    save_simple(tmp_path, tokenizer, 2)
    damage(tmp_path / "step-000002")

    fresh = tiny_model(tokenizer, seed=9)
    optimizer = torch.optim.AdamW(fresh.parameters())
    with caplog.at_level(logging.WARNING, logger="skillswarm.node.checkpointing"):
        state = load_training_checkpoint(tmp_path, fresh, optimizer)
    assert state is not None and state.step == 1 and state.data_position == {"cursor": 10}
    assert_same_weights(weights(fresh), weights(older))
    assert "step-000002" in caplog.text


def test_only_damaged_checkpoints_raise_an_error_naming_the_file(tmp_path: Path, tokenizer):
    save_simple(tmp_path, tokenizer, 4)
    _overwrite_header(tmp_path / "step-000004")
    with pytest.raises(CorruptCheckpointError, match=r"step-000004/model\.safetensors"):
        load_training_checkpoint(tmp_path, tiny_model(tokenizer))
    _garble_state(tmp_path / "step-000004")
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(CorruptCheckpointError, match="none is complete"):
        load_training_checkpoint(tmp_path, tiny_model(tokenizer))


def test_a_model_of_another_shape_is_refused(tmp_path: Path, tokenizer):
    save_simple(tmp_path, tokenizer, 0)
    wider = tiny_model(tokenizer, hidden=64)
    before = weights(wider)
    with pytest.raises(IncompatibleCheckpointError, match=r"model\.embed_tokens\.weight.*shape"):
        load_training_checkpoint(tmp_path, wider)
    assert_same_weights(weights(wider), before)


def test_no_checkpoint_gives_none(tmp_path: Path, tokenizer):
    assert load_training_checkpoint(tmp_path / "absent", tiny_model(tokenizer)) is None
    assert latest_checkpoint(tmp_path / "absent") is None
    assert load_training_checkpoint(tmp_path, tiny_model(tokenizer)) is None


def test_missing_latest_pointer_falls_back_to_the_newest_complete(tmp_path: Path, tokenizer):
    save_simple(tmp_path, tokenizer, 3)
    _, newest = save_simple(tmp_path, tokenizer, 5)
    (tmp_path / "latest").unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000005"
    fresh = tiny_model(tokenizer, seed=11)
    assert load_training_checkpoint(tmp_path, fresh).step == 5
    assert_same_weights(weights(fresh), weights(newest))


def test_leftovers_of_an_interrupted_save_are_ignored_and_cleaned(tmp_path: Path, tokenizer):
    _, saved = save_simple(tmp_path, tokenizer, 1)
    half_built = tmp_path / ".tmp-step-000002-4242-deadbeef"
    half_built.mkdir()
    shutil.copy(tmp_path / "step-000001" / "model.safetensors", half_built)
    pointer_temp = tmp_path / ".latest.4242.deadbeef.tmp"
    pointer_temp.write_text("step-000002\n")

    assert latest_checkpoint(tmp_path) == tmp_path / "step-000001"
    fresh = tiny_model(tokenizer, seed=3)
    assert load_training_checkpoint(tmp_path, fresh).step == 1
    assert_same_weights(weights(fresh), weights(saved))
    assert not half_built.exists() and not pointer_temp.exists()


def test_a_checkpoint_moved_aside_by_an_interrupted_replace_is_put_back(tmp_path: Path, tokenizer):
    _, saved = save_simple(tmp_path, tokenizer, 6)
    os.replace(tmp_path / "step-000006", tmp_path / ".replaced-step-000006-0badc0de")
    fresh = tiny_model(tokenizer, seed=2)
    assert load_training_checkpoint(tmp_path, fresh).step == 6
    assert_same_weights(weights(fresh), weights(saved))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000006"]


def test_state_that_is_not_plain_json_is_refused_before_writing(tmp_path: Path, tokenizer):
    model, optimizer, _ = make_trainer(tokenizer)
    with pytest.raises(ValueError, match="not plain JSON"):
        save_training_checkpoint(
            tmp_path, model, optimizer, TrainingState(step=1, data_position={"seen": {1, 2}})
        )
    with pytest.raises(ValueError, match="keep"):
        save_training_checkpoint(tmp_path, model, optimizer, TrainingState(step=1), keep=0)
    assert not any(tmp_path.iterdir())


def _save_killed_at(
    directory: Path, tokenizer, step: int, owner: object, attribute: str, skip_calls: int
) -> None:
    """Save `step` in a forked child that SIGKILLs itself on call number `skip_calls` + 1 of
    `owner.attribute`: a real crash at a chosen point of the save."""
    model, optimizer, _ = make_trainer(tokenizer, seed=100 + step)
    pid = os.fork()
    if pid == 0:
        try:
            original = getattr(owner, attribute)
            calls = 0

            def crash_then_call(*args, **kwargs):
                nonlocal calls
                calls += 1
                if calls > skip_calls:
                    os.kill(os.getpid(), signal.SIGKILL)
                return original(*args, **kwargs)

            setattr(owner, attribute, crash_then_call)
            save_training_checkpoint(directory, model, optimizer, TrainingState(step=step))
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


@pytest.mark.parametrize(
    ("crash_step", "owner", "attribute", "skip_calls", "expected_step"),
    [
        pytest.param(2, checkpointing, "_fsync_file", 2, 1, id="while-writing-files"),
        pytest.param(2, checkpointing, "write_bytes_atomically", 0, 1, id="before-pointer"),
        pytest.param(2, checkpointing, "_prune", 0, 2, id="before-pruning"),
        pytest.param(1, os, "replace", 1, 1, id="while-replacing-the-same-step"),
    ],
)
def test_a_save_killed_at_any_point_leaves_a_complete_checkpoint(
    tmp_path: Path, tokenizer, crash_step, owner, attribute, skip_calls, expected_step
):
    for step in (0, 1):
        save_simple(tmp_path, tokenizer, step, seed=100 + step)
    _save_killed_at(tmp_path, tokenizer, crash_step, owner, attribute, skip_calls)

    fresh = tiny_model(tokenizer, seed=7)
    state = load_training_checkpoint(tmp_path, fresh, torch.optim.AdamW(fresh.parameters()))
    assert state is not None and state.step == expected_step
    assert_same_weights(weights(fresh), weights(tiny_model(tokenizer, seed=100 + expected_step)))
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    save_simple(tmp_path, tokenizer, expected_step + 1, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        step_directory_name(expected_step),
        step_directory_name(expected_step + 1),
    ]


TRAINER_SCRIPT = textwrap.dedent(
    """
    import random
    import sys
    from pathlib import Path

    import numpy as np
    import torch

    from skillswarm.agent.model import TEMPLATE_FIXED_STRINGS, build_tiny_model, build_tokenizer
    from skillswarm.node.checkpointing import (
        TrainingState,
        load_training_checkpoint,
        save_training_checkpoint,
    )


    def train(checkpoints: Path | None, total_steps: int) -> dict[str, torch.Tensor]:
        torch.set_num_threads(1)
        tokenizer = build_tokenizer(TEMPLATE_FIXED_STRINGS)
        model = build_tiny_model(tokenizer, hidden=32, layers=1, heads=2, intermediate=64)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(0)
        state = None
        if checkpoints is not None:
            state = load_training_checkpoint(checkpoints, model, optimizer)
        start = 0 if state is None else state.step + 1
        print(f"start {start}", flush=True)
        for step in range(start, total_steps):
            input_ids = torch.randint(0, len(tokenizer), (4, 16))
            loss = model(input_ids=input_ids, labels=input_ids).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            position = {"next_batch": step + 1, "python_draw": random.random()}
            if checkpoints is not None:
                state = TrainingState(step=step, data_position=position, policy_version=step // 4)
                save_training_checkpoint(checkpoints, model, optimizer, state, tokenizer=tokenizer)
                print(f"saved {step}", flush=True)
        print("done", flush=True)
        return model.state_dict()


    if __name__ == "__main__":
        train(Path(sys.argv[1]), int(sys.argv[2]))
    """
)
TOTAL_STEPS = 80


def _start_trainer(script: Path, checkpoints: Path, log: Path) -> subprocess.Popen[str]:
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "a") as errors:
        return subprocess.Popen(
            [sys.executable, str(script), str(checkpoints), str(TOTAL_STEPS)],
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env=environment,
            cwd=REPO_ROOT,
        )


def _first_line(process: subprocess.Popen[str]) -> str:
    line = process.stdout.readline().strip()
    assert line.startswith("start "), f"trainer did not start: {line!r}"
    return line


def _kill_twice_and_check_resumes(
    script: Path, checkpoints: Path, log: Path, started: list[subprocess.Popen[str]]
) -> int:
    """Start the trainer, SIGKILL it shortly after a save at a random-ish step, check the newest
    complete checkpoint loads and that the next start resumes right after it; twice. Returns the
    step the next start begins at."""
    chooser = random.Random(os.getpid())
    expected_start = 0
    for kill_after in (chooser.randrange(2, 6), chooser.randrange(20, 30)):
        process = _start_trainer(script, checkpoints, log)
        started.append(process)
        assert _first_line(process) == f"start {expected_start}"
        last_saved = -1
        while last_saved < kill_after:
            line = process.stdout.readline().strip()
            assert line.startswith("saved "), f"trainer stopped early: {line!r}, see {log}"
            last_saved = int(line.split()[1])
        time.sleep(chooser.uniform(0.0, 0.06))  # saving is most of a step: usually lands in one
        process.send_signal(signal.SIGKILL)
        process.wait()
        assert process.returncode == -signal.SIGKILL, "the trainer ended before the kill"
        # Steps saved during the sleep: their lines reached the pipe before the kill.
        for line in process.stdout.read().split("\n"):
            if line.startswith("saved "):
                last_saved = int(line.split()[1])
        process.stdout.close()

        folder = latest_checkpoint(checkpoints)
        assert folder is not None
        model, _ = load_policy(folder)
        state = load_training_checkpoint(
            checkpoints, model, torch.optim.AdamW(model.parameters(), lr=1e-2)
        )
        # The kill came after `last_saved` was saved, at most during the save of the next step.
        assert state is not None and state.step in (last_saved, last_saved + 1)
        assert state.data_position["next_batch"] == state.step + 1
        assert not [p.name for p in checkpoints.iterdir() if p.name.startswith(".")]
        expected_start = state.step + 1
    return expected_start


def test_sigkilled_trainer_resumes_from_its_last_complete_checkpoint(tmp_path: Path):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER_SCRIPT)
    checkpoints = tmp_path / "checkpoints"
    log = tmp_path / "trainer.log"

    started: list[subprocess.Popen[str]] = []
    try:
        expected_start = _kill_twice_and_check_resumes(script, checkpoints, log, started)
        process = _start_trainer(script, checkpoints, log)
        started.append(process)
        assert _first_line(process) == f"start {expected_start}"
        remaining, _ = process.communicate(timeout=120)
    finally:
        for child in started:
            if child.poll() is None:
                child.kill()
                child.wait()
    assert process.returncode == 0
    lines = remaining.split()
    assert remaining.splitlines()[0] == f"saved {expected_start}" and lines[-1] == "done"

    final = latest_checkpoint(checkpoints)
    assert final is not None and final.name == f"step-{TOTAL_STEPS - 1:06d}"
    assert json.loads((final / "state.json").read_text())["step"] == TOTAL_STEPS - 1
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "latest",
        f"step-{TOTAL_STEPS - 2:06d}",
        f"step-{TOTAL_STEPS - 1:06d}",
    ]
    # The same script run in this process without interruption (and without checkpoints)
    # ends on the very same weights.
    uninterrupted = runpy.run_path(str(script), run_name="reference")["train"](None, TOTAL_STEPS)
    assert_same_weights(load_file(final / "model.safetensors"), weights_without_tied(uninterrupted))
