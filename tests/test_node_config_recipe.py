"""A node's [train] settings are its domain's recipe with the config's own fields laid over them,
one by one (loss fields too), the same after a TOML round trip and said in one line at start; and
a node waiting on a round goes on when the coordinator holds it and opens the next on the same
base."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import httpx
import pytest
import torch
from skillswarm.node.config import NodeConfig
from skillswarm.node.daemon import NodeDaemon, training_summary
from skillswarm.node.loss import LossConfig
from skillswarm.node.pipeline import RLConfig
from skillswarm.node.recipes import DOMAIN_RECIPES, recipe_for
from skillswarm.protocol.api import InfoOut
from skillswarm.protocol.delta import pack_delta
from skillswarm.protocol.identity import public_key_bytes
from skillswarm.protocol.manifest import sign_manifest
from skillswarm.protocol.tomlconfig import ConfigFileError, load_toml_config, write_toml_config

BASE = "b" * 64
MERGED = "c" * 64


# -- defaults and overrides ------------------------------------------------------------------


@pytest.mark.parametrize("domain", ["math", "code", "search"])
def test_a_daemon_trains_with_its_domains_recipe_by_default(tmp_path: Path, domain: str) -> None:
    daemon = NodeDaemon(NodeConfig(work_dir=tmp_path, domain=domain))
    daemon.client.close()
    assert daemon.config.train == recipe_for(domain)
    assert daemon.config.train.optimizer == "sgd"
    assert daemon.config.train_recipe == domain
    assert daemon.config.train_overrides == []


def test_the_default_node_is_a_math_node_on_the_math_recipe() -> None:
    config = NodeConfig()
    assert config.domain == "math"
    assert config.train == DOMAIN_RECIPES["math"]


def test_a_domain_without_a_recipe_starts_from_rl_config_defaults() -> None:
    assert "chess" not in DOMAIN_RECIPES
    config = NodeConfig(domain="chess")
    assert config.train == RLConfig()
    assert config.train_recipe is None
    assert config.train_overrides == []
    tuned = NodeConfig.model_validate({"domain": "chess", "train": {"steps": 3}})
    assert tuned.train == RLConfig(steps=3)
    assert tuned.train_overrides == ["steps"]


def _math_with(**changes: object) -> RLConfig:
    loss = changes.pop("loss", {})
    recipe = recipe_for("math")
    return recipe.model_copy(update={**changes, "loss": recipe.loss.model_copy(update=loss)})


def test_fields_set_in_a_dict_override_the_recipe_one_by_one() -> None:
    config = NodeConfig.model_validate(
        {"domain": "math", "train": {"steps": 20, "loss": {"kl_coef": 0.2}}}
    )
    assert config.train == _math_with(steps=20, loss={"kl_coef": 0.2})
    # The recipe's other loss settings stay: outcome-only advantages, not RLConfig's default.
    assert config.train.loss.turn_reward_weight == 0.0
    assert config.train.learning_rate == 0.007
    assert config.train_overrides == ["loss.kl_coef", "steps"]


def test_fields_set_on_an_rl_config_override_the_recipe_one_by_one() -> None:
    config = NodeConfig(
        domain="code", train=RLConfig(steps=20, loss=LossConfig(kl_coef=0.2, clip_high=0.28))
    )
    expected = recipe_for("code")
    expected = expected.model_copy(
        update={
            "steps": 20,
            "loss": expected.loss.model_copy(update={"kl_coef": 0.2, "clip_high": 0.28}),
        }
    )
    assert config.train == expected
    assert config.train.samples_per_task == 8  # code's recipe, not RLConfig's 4
    assert config.train.temperature == 0.5
    assert config.train_overrides == ["loss.clip_high", "loss.kl_coef", "steps"]


def test_a_field_set_to_rl_configs_default_still_overrides_the_recipe() -> None:
    config = NodeConfig(domain="search", train=RLConfig(optimizer="adamw", learning_rate=2e-4))
    assert config.train.optimizer == "adamw"
    assert config.train.learning_rate == 2e-4
    assert config.train.temperature == 0.7  # search's recipe
    assert config.train_overrides == ["learning_rate", "optimizer"]


def test_a_bad_train_field_names_its_path(tmp_path: Path) -> None:
    bad = tmp_path / "node.toml"
    bad.write_text('domain = "code"\n[train]\nsteps = 0\n[train.loss]\nkl_coef = -1\n')
    with pytest.raises(ConfigFileError) as refused:
        load_toml_config(bad, NodeConfig)
    assert "train.steps" in str(refused.value)
    assert "train.loss.kl_coef" in str(refused.value)
    bad.write_text("[train]\nstepz = 3\n")
    with pytest.raises(ConfigFileError, match=r"train\.stepz"):
        load_toml_config(bad, NodeConfig)


# -- TOML ------------------------------------------------------------------------------------


def test_a_partial_train_table_in_toml_is_laid_over_the_recipe(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text('domain = "search"\n[train]\nsteps = 3\n[train.loss]\nkl_coef = 0.02\n')
    config = load_toml_config(path, NodeConfig)
    recipe = recipe_for("search")
    assert config.train == recipe.model_copy(
        update={"steps": 3, "loss": recipe.loss.model_copy(update={"kl_coef": 0.02})}
    )


@pytest.mark.parametrize("domain", ["math", "code", "search", "chess"])
def test_a_config_written_and_read_back_trains_the_same(tmp_path: Path, domain: str) -> None:
    config = NodeConfig(
        work_dir=tmp_path / "node",
        domain=domain,
        train=RLConfig(steps=20, loss=LossConfig(kl_coef=0.2)),
    )
    again = load_toml_config(write_toml_config(config, tmp_path / "node.toml"), NodeConfig)
    assert again.train == config.train
    assert again.train_recipe == config.train_recipe
    assert again.train_overrides == config.train_overrides == ["loss.kl_coef", "steps"]
    assert again == config


# -- the line at start -----------------------------------------------------------------------


def test_the_summary_names_the_recipe_its_settings_and_the_overrides() -> None:
    config = NodeConfig(domain="math", train={"steps": 20})
    assert training_summary(config) == (
        "training with the math recipe (SGD lr 0.007, temperature 0.7, 8 tasks x 4 samples, "
        "KL to the round's base 0.1, guidance 0.25); overridden: steps=20"
    )
    plain = NodeConfig(domain="chess")
    assert training_summary(plain) == (
        "training with RLConfig's defaults, chess having no recipe, (AdamW lr 0.0002, "
        "temperature 1, 8 tasks x 4 samples); overridden: none"
    )


def test_a_starting_daemon_logs_its_training_settings(
    tmp_path: Path, not_a_coordinator: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = NodeConfig(
        work_dir=tmp_path,
        coordinator_url=not_a_coordinator,
        train=RLConfig(steps=20, loss=LossConfig(kl_coef=0.2)),
    )
    with caplog.at_level(logging.INFO, logger="skillswarm.node.daemon"):
        with pytest.raises(httpx.HTTPStatusError):
            NodeDaemon(config).run()
    assert (
        "training with the math recipe (SGD lr 0.007, temperature 0.7, 8 tasks x 4 samples, "
        "KL to the round's base 0.2, guidance 0.25); overridden: loss.kl_coef=0.2, steps=20"
    ) in caplog.messages


# -- held rounds -----------------------------------------------------------------------------


def _info(round_number: int, base_id: str) -> InfoOut:
    return InfoOut(
        peer_id="12D3KooWcoordinator",
        multiaddrs=[],
        topic="skillswarm/test",
        repo_id="skillswarm/agent",
        round=round_number,
        base_id=base_id,
        base_revision=base_id[:40],
        merge={},
    )


class ScriptedCoordinator:
    """Answers /v1/info from a script, one answer a call, the last one again and again."""

    url = "http://coordinator.invalid"

    def __init__(self, answers: list[InfoOut]) -> None:
        self.answers = list(answers)
        self.asked = 0

    def info(self) -> InfoOut:
        self.asked += 1
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]

    def close(self) -> None:
        pass


def _daemon_asking(tmp_path: Path, answers: list[InfoOut], **config: object) -> NodeDaemon:
    daemon = NodeDaemon(NodeConfig(work_dir=tmp_path, **config))
    daemon.client.close()
    daemon.client = ScriptedCoordinator(answers)  # type: ignore[assignment]
    return daemon


def test_a_held_round_ends_the_wait_on_the_same_base(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    daemon = _daemon_asking(tmp_path, [_info(4, BASE), _info(5, BASE)])
    with caplog.at_level(logging.INFO, logger="skillswarm.node.daemon"):
        assert daemon._wait_for_next_base(BASE, 4) == BASE
    assert daemon.client.asked == 2  # type: ignore[attr-defined]
    assert "round 4 was held; training round 5 from the same base" in caplog.messages


def test_a_published_merge_ends_the_wait_on_the_new_base(tmp_path: Path) -> None:
    daemon = _daemon_asking(tmp_path, [_info(5, MERGED)])
    assert daemon._wait_for_next_base(BASE, 4) == MERGED


def test_the_open_round_on_the_same_base_is_waited_out_until_the_timeout(tmp_path: Path) -> None:
    daemon = _daemon_asking(tmp_path, [_info(4, BASE)], round_timeout_s=0.5)
    started = time.monotonic()
    assert daemon._wait_for_next_base(BASE, 4) is None
    assert daemon.client.asked >= 1  # type: ignore[attr-defined]
    assert time.monotonic() - started < 10


def test_a_stopped_daemon_stops_waiting(tmp_path: Path) -> None:
    daemon = _daemon_asking(tmp_path, [_info(4, BASE)])
    daemon.stop()
    assert daemon._wait_for_next_base(BASE, 4) is None


def test_a_delta_kept_for_a_closed_round_is_not_offered_for_the_next(tmp_path: Path) -> None:
    """After a restart the node re-announces only a delta for the round now open: the kept delta
    of a held round (same base, earlier round) is trained anew, not announced again."""
    daemon = NodeDaemon(NodeConfig(work_dir=tmp_path))
    daemon.client.close()
    manifest = pack_delta(
        {"w": torch.zeros(4)},
        {"w": torch.ones(4)},
        daemon.blobs,
        peer_id=daemon.peer_id,
        public_key=public_key_bytes(daemon.key_pair),
        domain="math",
        base_id=BASE,
        round=4,
        steps=1,
    )
    signed = sign_manifest(manifest, daemon.key_pair)
    daemon._keep_manifest(signed)
    kept = daemon._kept_delta(BASE, 4)
    assert kept is not None and kept.manifest_id == signed.manifest_id
    assert daemon._kept_delta(BASE, 5) is None
