"""The load fallback (hf_retrace_vllm/fallback.py): plain steps where speculating measured slower, per load."""

import math
import random

import pytest

from hf_retrace_vllm.fallback import PLAIN, SPECULATE, LoadFallback, load_key


class Engine:
    """A synthetic engine: at each load, an arm's verification (seconds, tokens committed) and the making of its plan
    (seconds). A step's wall time is the verification of the previous plan plus the making of this one, as the
    proposer measures it."""

    def __init__(self, costs: dict, noise: float = 0.0, seed: int = 0):
        self.costs, self.noise, self.rng = costs, noise, random.Random(seed)
        self.previous = None

    def step(self, fallback: LoadFallback, requests: int) -> str:
        arm = fallback.choose(requests)
        if self.previous is not None:
            verify, committed, _ = self.costs[(self.previous, requests)]
            seconds = (verify + self.costs[(arm, requests)][2]) * (1 + self.noise * self.rng.uniform(-1, 1))
            fallback.observe(seconds, committed, requests, decode_only=True)
        self.previous = arm
        return arm


# (verify seconds, tokens committed, plan-making seconds): at 1 request speculating commits 2.2 tokens in 50 ms where
# a plain step commits 1 in 40 ms; at 32 running it commits 40 in 180 ms (4.75 ms a token with its 10 ms of policy)
# where a plain step commits 32 in 120 ms (3.84 ms a token)
COSTS = {
    (SPECULATE, 1): (0.050, 2.2, 0.003), (PLAIN, 1): (0.040, 1, 0.0005),
    (SPECULATE, 32): (0.180, 40, 0.010), (PLAIN, 32): (0.120, 32, 0.003),
}  # fmt: skip


def run(fallback, engine, requests, steps):
    return [engine.step(fallback, requests) for _ in range(steps)]


def test_speculation_stays_where_it_is_faster_and_the_plain_probes_thin_out():
    fallback = LoadFallback()
    arms = run(fallback, Engine(COSTS), 1, 2000)
    load = fallback.loads[load_key(1)]
    assert load.arm == SPECULATE and load.interval == fallback.max_interval
    # probes of 6 plain plans after 32, 64, ... 512 speculating ones: under 3% of the plans
    assert 0 < arms.count(PLAIN) == fallback.plain_steps < 0.03 * len(arms)
    assert arms[:32] == [SPECULATE] * 31 + [PLAIN] and arms[32:37] == [PLAIN] * 5 and arms[37] == SPECULATE


def test_plain_steps_where_speculating_is_slower_with_speculating_probes():
    fallback = LoadFallback()
    arms = run(fallback, Engine(COSTS), 32, 2000)
    load = fallback.loads[load_key(32)]
    assert load.arm == PLAIN
    assert arms[37:].count(SPECULATE) < 0.03 * len(arms)  # after the first probe: plain but for thinning probes
    rates = load.seconds_per_token()
    assert rates[PLAIN] == pytest.approx(0.123 / 32) and rates[SPECULATE] == pytest.approx(0.190 / 40)


def test_each_load_keeps_its_own_arm():
    fallback, engine = LoadFallback(), Engine(COSTS)
    for _ in range(20):  # loads taking turns, long enough at each for its probes to end
        run(fallback, engine, 1, 100)
        run(fallback, engine, 32, 100)
    assert fallback.loads[load_key(1)].arm == SPECULATE and fallback.loads[load_key(32)].arm == PLAIN


def test_speculation_returns_when_it_becomes_faster():
    fallback, engine = LoadFallback(), Engine(dict(COSTS))
    run(fallback, engine, 32, 300)
    assert fallback.loads[load_key(32)].arm == PLAIN
    engine.costs[(SPECULATE, 32)] = (0.150, 56, 0.010)  # the requests turned repetitive: 2.86 ms a token
    arms = run(fallback, engine, 32, 1200)
    assert fallback.loads[load_key(32)].arm == SPECULATE and arms[-100:].count(SPECULATE) > 90


def test_noise_within_the_margin_does_not_flip_the_arm():
    even = {(SPECULATE, 8): (0.0555, 10, 0.0050), (PLAIN, 8): (0.048, 8, 0.0005)}  # 6.05 and 6.06 ms a token
    fallback = LoadFallback()
    run(fallback, Engine(even, noise=0.01, seed=3), 8, 3000)
    load = fallback.loads[load_key(8)]
    assert load.arm == SPECULATE and load.interval == fallback.max_interval


def test_only_steps_whose_two_plans_share_an_arm_are_samples():
    fallback = LoadFallback(first_interval=2, probe_steps=3, min_samples=2, min_interval=1)
    assert not fallback.observe(0.1, 2, 4, True)  # no plan yet
    fallback.choose(4)
    fallback.choose(4)  # the probe starts here: plain
    assert not fallback.observe(0.1, 2, 4, True)  # verified a speculating plan, made a plain one
    fallback.choose(4)
    assert not fallback.observe(0.1, 4, 4, decode_only=False)  # a prefill in the step
    assert not fallback.observe(0.1, 0, 4, True)  # nothing committed
    assert fallback.observe(0.1, 4, 4, True)
    assert list(fallback.loads[load_key(4)].samples[PLAIN]) == [(pytest.approx(0.1), 4)]
    fallback.choose(0)  # nothing to plan: the next step is no sample
    fallback.choose(4)
    assert not fallback.observe(0.1, 4, 4, True)


def test_a_probe_cut_short_by_a_change_of_load_decides_nothing():
    fallback = LoadFallback(first_interval=4, min_interval=4)
    engine = Engine(COSTS)
    arms = run(fallback, engine, 32, 5)
    assert arms[-1] == PLAIN  # the probe began
    run(fallback, engine, 1, 3)  # the load moved: the probe ends with one plain sample
    load = fallback.loads[load_key(32)]
    assert load.arm == SPECULATE and load.interval == 4 and load.since_probe == 0


class SpreadEngine(Engine):
    """Batch 1 where a speculating step commits 1 token twice in three and 7 once, at 150 ms each: 50 ms a token
    over the steps, 150 ms a token as the median of each step's ratio; a plain step commits 1 token in 100 ms."""

    def step(self, fallback: LoadFallback, requests: int) -> str:
        arm = fallback.choose(requests)
        if self.previous is not None:
            self.n = getattr(self, "n", 0) + 1
            committed = 1 if self.previous == PLAIN else (7 if self.n % 3 == 0 else 1)
            fallback.observe(0.100 if self.previous == PLAIN else 0.150, committed, requests, decode_only=True)
        self.previous = arm
        return arm


def test_an_arm_is_priced_by_its_tokens_summed_not_a_median_of_step_ratios():
    fallback = LoadFallback()
    arms = run(fallback, SpreadEngine({}), 1, 600)
    load = fallback.loads[load_key(1)]
    assert load.arm == SPECULATE and fallback.probes >= 3  # every probe confirmed speculating
    assert load.seconds_per_token()[SPECULATE] == pytest.approx(0.050, rel=0.15)
    assert load.seconds_per_token()[PLAIN] == pytest.approx(0.100)
    assert arms[-100:].count(SPECULATE) > 90


def test_a_load_whose_plans_expect_little_probes_within_a_short_wave():
    """At 32 running plans that expect 5% over a plain step probe after 8 plans, not 32 (0.05 / 0.5 of the interval,
    at least `min_interval`): a 40-step wave switches to plain after its 14th plan instead of not at all, and then
    keeps its whole interval (32) before a speculating probe."""
    fallback, engine, arms = LoadFallback(), Engine(COSTS), []
    for _ in range(40):
        arms.append(engine.step(fallback, 32))
        if arms[-1] == SPECULATE:
            fallback.expect(32, 0.05)
    load = fallback.loads[load_key(32)]
    assert arms[:8] == [SPECULATE] * 7 + [PLAIN] and arms[8:14] == [PLAIN] * 6
    assert load.arm == PLAIN and arms[14:].count(SPECULATE) == 0 and fallback.due(load) == 32
    assert fallback.as_dict()["loads"][str(load_key(32))]["predicted_gain"] == pytest.approx(0.05)


@pytest.mark.parametrize("gains, due", [([], 32), ([0.9], 32), ([0.5], 32), ([0.25], 16), ([0.1, 0.2, 0.3], 13),
                                        ([0.05], 8), ([-0.2], 8), ([None, math.nan, 0.25], 16)])  # fmt: skip
def test_the_probe_interval_shrinks_with_the_predicted_gain(gains, due):
    fallback = LoadFallback()
    for gain in gains:
        fallback.expect(8, gain)
    assert fallback.due(fallback._load(load_key(8))) == due
    fallback.expect(0, 0.01)  # nothing decoding: no load to learn about
    assert load_key(0) not in fallback.loads


def test_a_large_predicted_gain_keeps_the_whole_interval():
    fallback, engine = LoadFallback(), Engine(COSTS)
    arms = []
    for _ in range(40):
        arms.append(engine.step(fallback, 1))
        fallback.expect(1, 1.9)
    assert arms[:32] == [SPECULATE] * 31 + [PLAIN]


class RequestsEngine(Engine):
    """Batch 1 serving one request after another: `costs[(arm, request)]` as `Engine`'s, the request's id given to
    the fallback with each plan."""

    def step(self, fallback: LoadFallback, request: str) -> str:
        arm = fallback.choose(1, [request])
        if self.previous is not None:
            verify, committed, _ = self.costs[(self.previous, request)]
            fallback.observe(verify + self.costs[(arm, request)][2], committed, 1, decode_only=True)
        self.previous = arm
        return arm


# request "prose" drafts badly (1.1 tokens in 50 ms: 48 ms a token against a plain step's 40); "code" repeats itself
# (3 tokens in 50 ms: 18 ms a token)
PER_REQUEST = {
    (SPECULATE, "prose"): (0.050, 1.1, 0.003), (PLAIN, "prose"): (0.040, 1, 0.0005),
    (SPECULATE, "code"): (0.050, 3.0, 0.003), (PLAIN, "code"): (0.040, 1, 0.0005),
}  # fmt: skip


def serve(fallback, engine, request, steps):
    return [engine.step(fallback, request) for _ in range(steps)]


def test_a_new_request_at_a_load_running_plain_probes_speculating_soon():
    fallback, engine = LoadFallback(), RequestsEngine(PER_REQUEST)
    serve(fallback, engine, "prose", 400)
    load = fallback.loads[load_key(1)]
    assert load.arm == PLAIN and load.interval >= 256 and fallback.turnovers == 0
    arms = serve(fallback, engine, "code", 60)
    # 8 plain plans, a probe of 6 speculating ones, then speculating: the samples of "prose" were dropped
    assert fallback.turnovers == 1 and arms[:7] == [PLAIN] * 7 and arms[7:13] == [SPECULATE] * 6
    assert load.arm == SPECULATE and arms[13:44] == [SPECULATE] * 31 and not load.stale  # until its plain probe
    assert load.seconds_per_token()[SPECULATE] == pytest.approx(0.053 / 3)


def test_without_request_ids_a_load_running_plain_keeps_its_interval():
    fallback, engine = LoadFallback(), Engine({**COSTS, (SPECULATE, 1): (0.050, 1.1, 0.003)})
    run(fallback, engine, 1, 400)
    engine.costs[(SPECULATE, 1)] = (0.050, 3.0, 0.003)  # the next request repeats itself, unseen by the fallback
    arms = run(fallback, engine, 1, 60)
    assert fallback.loads[load_key(1)].arm == PLAIN and arms.count(SPECULATE) == 0


def test_a_new_request_that_drafts_badly_too_stays_plain_and_the_next_one_probes_again():
    fallback, engine = LoadFallback(), RequestsEngine(PER_REQUEST)
    serve(fallback, engine, "prose", 400)
    engine.costs.update({(arm, "prose-2"): engine.costs[(arm, "prose")] for arm in (SPECULATE, PLAIN)})
    arms = serve(fallback, engine, "prose-2", 60)
    load = fallback.loads[load_key(1)]
    assert fallback.turnovers == 1 and arms.count(SPECULATE) == 6 and load.arm == PLAIN and not load.stale
    engine.costs.update({(arm, "prose-3"): engine.costs[(arm, "prose")] for arm in (SPECULATE, PLAIN)})
    assert serve(fallback, engine, "prose-3", 60).count(SPECULATE) == 6 and fallback.turnovers == 2


def test_requests_that_change_in_part_keep_the_schedule():
    fallback = LoadFallback()
    for _ in range(300):  # 8 running where speculating loses: plain
        fallback.choose(8, [f"a{i}" for i in range(8)])
        fallback.observe(0.05, 8 if fallback._arms[0] == PLAIN else 6, 8, decode_only=True)
    load = fallback.loads[load_key(8)]
    assert load.arm == PLAIN and not load.stale
    fallback.choose(8, [f"a{i}" for i in range(4)] + [f"b{i}" for i in range(4)])  # half of them new
    assert not load.stale and fallback.turnovers == 0
    fallback.choose(8, [f"b{i}" for i in range(8)])  # none of them left
    assert load.stale and fallback.turnovers == 1 and fallback.due(load) == fallback.min_interval
    assert fallback.as_dict()["turnovers"] == 1


def test_load_buckets_are_quarter_octaves():
    assert [load_key(n) for n in (1, 2, 8, 9, 16, 28, 32)] == [0, 4, 12, 13, 16, 19, 20]


@pytest.mark.parametrize("kwargs", [{"first_interval": 0}, {"first_interval": 64, "max_interval": 32},
                                    {"probe_steps": 1}, {"min_samples": 6}, {"margin": 1.0}, {"min_interval": 0},
                                    {"min_interval": 40}, {"reference_gain": 0.0}])  # fmt: skip
def test_bad_settings_are_a_clear_error(kwargs):
    with pytest.raises(ValueError, match="LoadFallback needs"):
        LoadFallback(**kwargs)
