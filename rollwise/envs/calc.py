"""The `calc` task: multiply a 3-digit number by a 2- or 3-digit one, with a `<calc>` calculator tool.

SmolLM2-135M cannot do these products alone, and with the tool only described in the system prompt it makes
no parseable call (0/24 greedy); after one worked example in the conversation it calls the tool 24/24 times
greedy. Training therefore starts from worked examples and withdraws them as it succeeds, with the hard-sample
substitution of ToolExpander (Chen et al. 2025, "ToolExpander: Extending the Frontiers of Tool-Using
Reinforcement Learning to Weak LLMs"): a group with no correct answer is drawn again later WITH an example.

- `example_prob` (curriculum state, starts at `env.options.example_prob`, default 1.0): the chance that a fresh
  training prompt carries the worked example. After each step whose accuracy on example prompts reaches
  `withdraw_at`, it drops by `withdraw_step` (down to 0).
- Substitution (rollwise.envs.substitution): a group of a prompt without the example that got no correct answer
  is sampled again behind an example (`guided_samples` episodes); the correct ones replace up to
  `max_replaced_frac` of its wrong samples, trained as answers to the unguided prompt.
- Held-out split by fact: the (a, b) pairs of the evaluation prompts (in either order) are never trained.
  Evaluation prompts never carry an example.
The curriculum state is saved in checkpoints (`state_dict`), so a resumed run continues it.
"""

from __future__ import annotations

import random
from typing import Any

from rollwise.config import DataConfig
from rollwise.data.tasks import EVAL_SEED, first_held_out, text_uid
from rollwise.types import Group, Prompt

SYSTEM = ("You are a helpful assistant with a calculator. To compute, write <calc>EXPRESSION</calc>, for "
          "example <calc>12*34</calc>, and wait: the result comes back in a tool message. Then state the final "
          "answer as a number.")
PHRASINGS = ("What is {a} * {b}?", "Compute {a} * {b}.", "Calculate {a} times {b}.", "What is the product of {a} "
             "and {b}?")


def fact(a: int, b: int) -> tuple[int, int]:
    return (min(a, b), max(a, b))


def worked_example(a: int, b: int) -> list[dict[str, str]]:
    """One solved exchange: question, a tool call, its result, the answer."""
    return [{"role": "user", "content": f"What is {a} * {b}?"},
            {"role": "assistant", "content": f"<calc>{a}*{b}</calc>"},
            {"role": "tool", "content": str(a * b)},
            {"role": "assistant", "content": f"The answer is {a * b}."}]


class CalcTask:
    """Prompt source of the calc task, with its example curriculum (see the module docstring)."""

    name = "calc"
    default_reward = "arith"
    default_env = "calc"
    system_prompt = SYSTEM  # for prompts from a file run in this environment (`rollwise eval --data`)
    splits = ("prompt", "fact")  # always held out by fact, which implies by prompt text

    def __init__(self, cfg: DataConfig, seed: int, example_prob: float = 1.0, withdraw_at: float = 0.5,
                 withdraw_step: float = 0.1, guided_samples: int = 4, max_replaced_frac: float = 0.5) -> None:
        self.seed = seed
        self.example_prob = float(example_prob)
        self.withdraw_at, self.withdraw_step = float(withdraw_at), float(withdraw_step)
        self.substitution_options = {"guided_samples": int(guided_samples), "max_replaced_frac": float(max_replaced_frac)}
        rng = random.Random(f"calc-eval-{EVAL_SEED}")
        self._eval: list[Prompt] = []
        self._eval_facts: set[tuple[int, int]] = set()
        while len(self._eval) < cfg.eval_size:
            a, b, phrasing = self._draw(rng)
            if fact(a, b) not in self._eval_facts:
                self._eval_facts.add(fact(a, b))
                self._eval.append(self._prompt(a, b, phrasing, None, f"calc:eval {len(self._eval)}"))

    @staticmethod
    def _draw(rng: random.Random) -> tuple[int, int, int]:
        a = rng.randint(100, 999)
        b = rng.randint(10, 99) if rng.random() < 0.5 else rng.randint(100, 999)
        return a, b, rng.randrange(len(PHRASINGS))

    def _prompt(self, a: int, b: int, phrasing: int, example: tuple[int, int] | None, source: str) -> Prompt:
        text = PHRASINGS[phrasing].format(a=a, b=b)
        messages = [{"role": "system", "content": SYSTEM}]
        if example is not None:
            messages += worked_example(*example)
        messages.append({"role": "user", "content": text})
        info = {"a": a, "b": b, "phrasing": phrasing, "example": list(example) if example else None}
        uid = text_uid(self.name, text + (f"|example {example}" if example else ""))
        return Prompt(uid=uid, messages=messages, answer=str(a * b), source=source, info=info)

    def _train_draw(self, rng: random.Random) -> tuple[int, int, int]:
        for _ in range(1000):
            a, b, phrasing = self._draw(rng)
            if fact(a, b) not in self._eval_facts:
                return a, b, phrasing
        raise RuntimeError("calc: 1000 draws in a row hit the held-out facts")

    def train_prompt(self, position: int) -> Prompt:
        """The training prompt at `position`, with the worked example with probability `example_prob`."""
        rng = random.Random(f"calc-train-{self.seed}-{position}")
        example = self._train_draw(rng)[:2]
        a, b, phrasing = self._train_draw(rng)
        with_example = rng.random() < self.example_prob
        return self._prompt(a, b, phrasing, example if with_example else None, f"calc:train {position}")

    def guided_prompt(self, prompt: Prompt) -> Prompt | None:
        """The same problem behind a worked example (hard-sample substitution); None if it already has one."""
        info = prompt.info
        if info.get("example"):
            return None
        rng = random.Random(f"calc-guide-{prompt.uid}")
        example = self._train_draw(rng)[:2]
        return self._prompt(info["a"], info["b"], info["phrasing"], example, f"{prompt.source} (guided)")

    def observe(self, groups: list[Group]) -> dict[str, float]:
        """Update the curriculum from a step's scored groups; returns `curriculum/*` metrics."""
        with_ex = [s for g in groups if g.prompt.info.get("example") for s in g.usable()]
        accuracy = sum(bool(s.correct) for s in with_ex) / len(with_ex) if with_ex else None
        if accuracy is not None and accuracy >= self.withdraw_at:
            self.example_prob = max(0.0, round(self.example_prob - self.withdraw_step, 9))
        out = {"curriculum/example_prob": self.example_prob}
        if accuracy is not None:
            out["curriculum/example_accuracy"] = accuracy
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"example_prob": self.example_prob}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.example_prob = state["example_prob"]

    def is_held_out(self, a: int, b: int) -> bool:
        return fact(a, b) in self._eval_facts

    @property
    def num_eval(self) -> int:
        return len(self._eval)

    def split_summary(self) -> str:
        return (f"task calc (3-digit x 2/3-digit products with a <calc> tool) -> {len(self._eval)} held-out "
                "prompts, split by fact (no held-out pair is trained in either order); eval has no worked example")

    def eval_prompts(self, n: int) -> list[Prompt]:
        return first_held_out(self.name, self._eval, n)


def calc_task(cfg: DataConfig, seed: int) -> CalcTask:
    """Built-in calc task (see `CalcTask`; registered by name in `rollwise.data.tasks`)."""
    try:
        return CalcTask(cfg, seed, **cfg.options)
    except TypeError as exc:
        raise ValueError(f"data.options of task 'calc': {exc} (it takes example_prob, withdraw_at, withdraw_step, "
                         "guided_samples, max_replaced_frac)") from None
