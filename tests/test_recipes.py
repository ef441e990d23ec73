"""Per-domain RL recipes: one for every registered domain, each a valid RLConfig that survives a
round trip through the TOML-shaped dict a node config holds, handed out as independent copies, and
the [train] settings of a node of that domain that sets none of its own."""

from __future__ import annotations

import pytest
from skillswarm.agent.envs import list_environments
from skillswarm.node.config import NodeConfig
from skillswarm.node.pipeline import RLConfig
from skillswarm.node.recipes import DOMAIN_RECIPES, NoRecipeError, recipe_for


def test_every_built_in_domain_has_a_recipe() -> None:
    # environments installed packages add through entry points bring their own settings
    assert {"math", "code", "search"} <= set(list_environments())
    assert set(DOMAIN_RECIPES) == {"math", "code", "search"}


@pytest.mark.parametrize("domain", sorted(DOMAIN_RECIPES))
def test_recipe_validates_as_an_rl_config(domain: str) -> None:
    recipe = recipe_for(domain)
    dumped = recipe.model_dump(mode="json")
    assert RLConfig.model_validate(dumped) == recipe
    assert recipe.samples_per_task >= 2
    assert recipe.max_staleness >= recipe.weight_sync_every - 1


def test_recipe_for_hands_out_copies() -> None:
    first = recipe_for("math")
    first.learning_rate = 1.0
    first.loss.clip_high = 0.5
    again = recipe_for("math")
    assert again == DOMAIN_RECIPES["math"]
    assert again.learning_rate != 1.0
    assert again.loss.clip_high != 0.5


def test_unknown_domain_is_refused_with_the_known_ones_named() -> None:
    with pytest.raises(NoRecipeError, match="math"):
        recipe_for("chess")


@pytest.mark.parametrize("domain", sorted(DOMAIN_RECIPES))
def test_recipe_is_a_nodes_default_train_settings(domain: str) -> None:
    config = NodeConfig.model_validate({"domain": domain})
    assert config.train == DOMAIN_RECIPES[domain]
    assert config.train is not DOMAIN_RECIPES[domain]
    config.train.loss.kl_coef = 0.5  # a node's copy, not the recipe itself
    assert DOMAIN_RECIPES[domain].loss.kl_coef == 0.1
