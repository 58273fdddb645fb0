"""The getting-started page's offline recipes that learn (issue 54 item 4), run as the page writes them.

The section "Training that learns, offline" holds two bash blocks: the first builds the lab's base (its policy,
store and RL prompts) and trains one method on it; the second trains the other methods on the same base. Every train
command of both is parsed here into its stage's validated config (what the command checks before it loads anything),
so each recipe's keys and values stay right as the configs change; the first block's train command runs as written
on the base of the lab's own ``--quick`` run (``tests/lab/test_lab_quick.py``, which builds that base once for the
suite), and its reward must rise there.
"""

from __future__ import annotations

from nemo_factuality.testing.doc_recipes import recipe_blocks, train_commands


def test_every_recipe_is_a_valid_config_for_its_stage():
    """Each method's command of the section (both blocks) parses into its stage's config with the method's lab reward
    and the lab's base, store and prompts; five methods, each once."""
    from nemo_factuality.trainers.cli import parse_stage_config

    blocks = recipe_blocks()
    assert len(blocks) == 2, blocks
    base = "outputs/lab_base/seed0"
    commands = [c for block in blocks for c in train_commands(block, {"B": base})]
    rewards = []
    for argv in commands:
        cfg, _ = parse_stage_config(argv[0], argv[1:])
        assert cfg.reward["store_path"] == f"{base}/kb.sqlite" and cfg.model.path == f"{base}/checkpoints/base"
        assert cfg.data.train == f"{base}/rl_prompts.jsonl" and cfg.data.format == "jsonl"
        assert not cfg.data.apply_chat_template  # the lab's tokenizer has none
        rewards.append(cfg.reward["name"])
    assert sorted(rewards) == ["lab_factalign", "lab_fspo", "lab_klcf", "lab_knowrl", "lab_rlfh"], rewards
