"""The claim that matters most for an RL library, as a test: the real loop makes the reward climb.

A tiny model is fine-tuned (sft.py) to pick the left door 30% of the time in ChoiceEnv (tests/fake_env.py), then
trained by grpo.main itself (real rollout, real loss, real optimizer, one process) with reward 1 for `left`.
The reward must rise above 0.75 within a few dozen steps (above 0.6 with LoRA adapters in place of full training);
with the sign of the advantages flipped, the same run must not rise (it falls towards 0), with adapters too.

lr 5e-4 with 5 warm-up steps, measured here over seeds 0-3 of the run (the rollout's noise): the last 5 steps' reward
0.82-0.87 with 5e-4 on one CPU, 0.80 / 0.82 / 0.86 / 0.82 on another with the same torch (its kernels round otherwise,
so the same seed samples another run: seed 0, the test's, gave exactly 0.80 there, hence 0.75, not 0.8); with 1e-3 and 7e-4 one seed in four breaks the tool-call format in one update and never recovers
(reward 0 from then on: Adam moves each weight of the 0.1M-parameter policy by up to a few lr, whatever the size of its
gradient); 2e-3 without warm-up collapses within a few steps and 1e-4 does not move it in 30. A sign error, advantages
given to the wrong episodes, or a loss mask on the wrong tokens each fail one of the two."""
import json

import pytest

import grpo
import loss
import sft
from fake_env import choice_conversation

STEPS = 30


@pytest.fixture(scope="module")
def start(tmp_path_factory, tiny_tok, tiny_lm):
    """A policy that calls `left` about 30% of the time and otherwise `right`, in the episode's exact format."""
    init = tmp_path_factory.mktemp("random")
    tiny_lm.save_pretrained(init)
    tiny_tok.save_pretrained(init)
    data = [choice_conversation("left" if i % 10 < 3 else "right") for i in range(40)]
    out = tmp_path_factory.mktemp("sft")
    return sft.train(sft.SFTConfig(model=str(init), out=str(out), epochs=40, batch_size=8, lr=5e-3, seed=0), data)


# The same run with LoRA adapters of rank 8 on every projection, the base frozen (--lora-rank). Measured here over 30
# steps: lr 3e-3 climbs to 0.71-0.76 at seeds 0-2 (the rest: turns that run past --max-new-tokens, which the frozen
# output layer cannot sharpen away as the full run does); 5e-3 climbed to ~0.7 with the former sampler but at seed 0
# of the batch sampler broke the format at step 22 (0.75, then 0 to the end); 1e-2 collapses at step 13.
LORA = ["--lora-rank", "8", "--lr", "3e-3"]


def run(start, out, monkeypatch=None, flip=False, extra=()):
    if flip:  # the negative control: every advantage with the opposite sign
        real = loss.group_advantages
        monkeypatch.setattr(loss, "group_advantages", lambda *a, **k: -real(*a, **k))
    grpo.main(["--init-from", str(start), "--env", "tests.fake_env:ChoiceEnv", "--steps", str(STEPS),
               "--tasks-per-step", "4", "--group-size", "8", "--lr", "5e-4", "--warmup-steps", "5", "--max-new-tokens", "32",
               "--max-context", "640", "--max-turns", "4", "--eval-tasks", "0", "--save-every", "1000",
               "--micro-batch-size", "16", "--temperature", "1.0", "--out-dir", str(out), *extra])
    return [json.loads(line)["reward_mean"] for line in open(out / "metrics.jsonl")]


@pytest.mark.parametrize("extra", [(), LORA], ids=["full", "lora"])
def test_grpo_reward_climbs(start, tmp_path, extra):
    rewards = run(start, tmp_path / "run", extra=extra)
    print("reward per step:", " ".join(f"{r:.2f}" for r in rewards))
    first, last = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
    assert 0.1 <= first <= 0.6, f"the starting policy should pick left 20-50% of the time, got {first:.2f}"
    assert last > (0.6 if extra else 0.75), f"GRPO did not learn the choice: reward {first:.2f} -> {last:.2f}"


@pytest.mark.parametrize("extra", [(), LORA], ids=["full", "lora"])
def test_grpo_with_flipped_advantages_does_not_climb(start, tmp_path, monkeypatch, extra):
    rewards = run(start, tmp_path / "run", monkeypatch, flip=True, extra=extra)
    print("reward per step:", " ".join(f"{r:.2f}" for r in rewards))
    first, last = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
    assert 0.1 <= first <= 0.6, f"the starting policy should pick left 20-50% of the time, got {first:.2f}"
    assert last < first and last < 0.3, f"with flipped advantages the reward still rose: {first:.2f} -> {last:.2f}"
