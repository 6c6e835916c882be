"""Multi-turn episodes on the tiny model (``environments.runner.run_episodes``):

* an episode's tokens, loss mask and log-probs equal a hand-built reference (plain ``generate`` turn
  by turn, observations appended), and a full-sequence trainer forward reproduces the rollout's
  log-probs on every sampled token of every turn (observations masked out);
* single-turn episodes are exactly today's ``generate`` call;
* a hanging environment step times out: its episode ends (flagged, no further turns), the others
  finish all their turns, and the call returns within the timeout, not the hang;
* TP=2 (steps on the model-parallel source rank, outcomes broadcast) holds the same episodes.
"""

import pytest
import torch

from megatron_cascade.testing import run_distributed
from episode_workers import BUDGET, PARAMS, PROMPTS, TURNS, episodes_worker

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("episodes") / "weights")


@pytest.fixture(scope="module")
def ranks(weights_dir):
    return run_distributed(episodes_worker, 2, weights_dir, timeout_s=300)


@pytest.fixture(scope="module")
def ref(ranks):
    """The TP=1 checks of rank 0 (rank 1, the other data-parallel replica, ran the same)."""
    return ranks[0]


def test_episode_equals_hand_built_reference(ref):
    got, want = ref["episodes"], ref["reference"]
    assert got["response"] == want["response"]
    assert got["mask"] == want["mask"]
    assert got["turns"] == want["turns"] and got["finish"] == want["finish"]
    for a, b in zip(got["logprobs"], want["logprobs"], strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-6, rtol=0)
    # The scripted environment took every turn it could: several turns, observations in the middle.
    assert max(got["turns"]) == TURNS and sum(0 in m for m in got["mask"]) >= 2
    assert ref["finished"] == len(got["turns"])  # every started episode was released (finish)
    for rewards, turns, finish in zip(got["turn_rewards"], got["turns"], got["finish"]):
        assert len(rewards) == (turns if finish == "stop" else turns - 1)


def test_packed_episode_masks_observations_and_matches_the_trainer(ref):
    """Packed: the response follows the prompt; the loss mask (aligned to the predicting position) is
    the episode's mask; observation tokens carry inference log-prob 0."""
    got, check = ref["episodes"], ref["trainer"]
    for row, (response, mask) in enumerate(zip(got["response"], got["mask"])):
        tokens, loss_mask = check["tokens"][row], check["loss_mask"][row]
        p = len(PROMPTS[row // PARAMS.n])
        assert tokens[p:p + len(response)] == response
        assert loss_mask[p - 1:p - 1 + len(response)] == [float(m) for m in mask]
        assert sum(loss_mask) == sum(mask)
        inference = check["inference_logprobs"][row][p - 1:p - 1 + len(response)]
        assert [lp for lp, m in zip(inference, mask) if not m] == [0.0] * (len(mask) - sum(mask))
    assert check["masked_tokens"] >= 10
    assert check["max_diff"] < 1e-5


def test_token_budget_cuts_an_episode_to_a_prefix(ref):
    """environment.max_episode_tokens: tokens after the prompt, observations included; the turn that
    crosses it is cut there (finish "length"): the same tokens as the unbounded episode's prefix."""
    short, full = ref["short"], ref["episodes"]
    assert any(f == "length" for f in short["finish"])
    for response, mask, finish, whole in zip(short["response"], short["mask"], short["finish"], full["response"]):
        assert len(response) <= BUDGET and len(mask) == len(response)
        assert response == whole[:len(response)]
        assert finish == "stop" or mask[-1] == 1  # a cut episode ends on a sampled token


def test_single_turn_episodes_are_todays_generate(ref):
    assert ref["single"]["response"] == ref["plain"]["response"]
    assert ref["single"]["logprobs"] == ref["plain"]["logprobs"]
    assert ref["single"]["finish"] == ref["plain"]["finish"]
    assert ref["single"]["turns"] == [1] * len(ref["plain"]["response"])
    assert all(m == [1] * len(r) for m, r in zip(ref["single"]["mask"], ref["single"]["response"]))


def test_hanging_step_times_out_and_the_others_finish(ref):
    """Prompt 2's second environment step sleeps 60 s; the step timeout is 1 s. Its episode ends there
    (flagged: the stage scores it 0), the other two take all their turns, and the call returns in
    seconds."""
    hang = ref["hang"]
    assert hang["timed_out"] == [False, False, True]
    assert hang["turns"] == [TURNS, TURNS, 2]
    assert hang["finish"] == ["stop", "stop", "stop"]
    assert ref["hang_finished"] == [0, 1, 2]  # the hung episode's resources were released too
    assert ref["hang_s"] < 30


def test_episode_abandoned_while_its_environment_starts_is_released(ref):
    """Prompt 2's ``start`` (e.g. a workspace checkout) takes 1 s, past the 0.3 s step timeout: the
    episode ends at once, and its state is released (``finish``) when the abandoned ``start``
    returns. Before, ``finish`` was owed only for states the runner saw started: never called."""
    assert ref["slow_start"]["timed_out"] == [False, False, True]
    assert ref["slow_start_finished"] == [0, 1, 2]


def test_tensor_parallel_episodes_equal_single_rank(ranks):
    for rank in ranks:
        tp2 = rank["tp2"]
        assert tp2["response"] == ranks[0]["episodes"]["response"]
        assert tp2["mask"] == ranks[0]["episodes"]["mask"]
        for a, b in zip(tp2["logprobs"], ranks[0]["episodes"]["logprobs"], strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    assert ranks[1]["episodes"] == ranks[0]["episodes"]  # data-parallel replicas: no per-turn collective
