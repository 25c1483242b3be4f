"""The `lookup` task, environment and reward: questions about FICTIONAL records behind a `<lookup>NAME</lookup>` tool.

A fixed world of fictional people (a plain first and last name drawn at random, a made-up home town, a birth year, an
occupation and a pet) is drawn from a seeded RNG, so the answer to "What is the occupation of Felix Vance?"
cannot be known without calling the tool:

    <lookup>Felix Vance</lookup>   ->   Felix Vance: born in Pustix, year 1756, occupation tanner, pet toad

Each prompt carries its own small database in `prompt.info["records"]` (the asked-about record and a few
others); the tool (`LookupEnv.tools_for(prompt)`) looks names up there only, and an unknown name is an error
the policy reads back ("no record named ..."). The held-out split is BY RECORD: a fixed fifth of the world is
held out, and eval prompts use only held-out records (asked-about and the others), training prompts only the
rest, so no record appears in both. The world and the split depend on neither the training seed nor
`data.eval_size`.

Each prompt opens with a system message describing the tool and, by default, one worked example exchange
(question, call, tool result, answer) about a record outside the world: SmolLM2-135M makes no parseable call
from a description alone (issue 12), but copies the format after one example. Reward `lookup`: the final
assistant message, normalised, equals the attribute.
"""

from __future__ import annotations

import random
import re
from typing import Any

from rollwise.config import DataConfig, EnvConfig
from rollwise.data.tasks import EVAL_SEED, ProceduralTask, text_uid
from rollwise.envs.base import Tool
from rollwise.envs.tool_env import ToolEnv
from rollwise.rewards.verifiers import reference, verdict
from rollwise.types import Message, Prompt, RewardResult, Sample

NUM_RECORDS = 2000  # people in the world
HELD_OUT_FRACTION = 0.2  # of the records: eval prompts use only these
DISTRACTORS = 3  # other records in each prompt's database
MAX_NAME_DRAWS = 100  # redraws of a name that is already taken

ONSETS = ("b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "qu", "r", "s", "st", "t", "th",
          "v", "w", "z")
VOWELS = ("a", "e", "i", "o", "u", "ae", "ia", "ou")
CODAS = ("", "", "l", "n", "r", "s", "th", "x", "m", "nd", "rk", "st")
# people get plain, easily copied first and last names (a 135M model garbles invented ones when it writes the
# call); the combinations and every attribute are still drawn at random, so no answer can be known
FIRST_NAMES = ("Anna", "Ben", "Clara", "David", "Emma", "Felix", "Grace", "Henry", "Iris", "Jack", "Karen", "Leo",
               "Maria", "Nina", "Oscar", "Paul", "Rosa", "Sam", "Tara", "Victor", "Wendy", "Adam", "Bella", "Carl",
               "Diana", "Eric", "Fiona", "George", "Hannah", "Ivan", "Julia", "Kevin", "Laura", "Mark", "Nora",
               "Owen", "Peter", "Ruth", "Simon", "Tom", "Ursula", "Vera", "Walter", "Alice", "Bruno", "Chloe",
               "Daniel", "Elena", "Frank", "Helen")
LAST_NAMES = ("Holt", "Berg", "Carter", "Dunn", "Ellis", "Fox", "Grant", "Hayes", "Irwin", "Jones", "Keller", "Lane",
              "Moss", "Nash", "Owens", "Price", "Reed", "Stone", "Turner", "Vance", "Walsh", "Young", "Adler",
              "Baker", "Cole", "Drake", "Evans", "Fisher", "Gray", "Hart", "Knox", "Lloyd", "Mills", "Norris", "Olsen",
              "Parker", "Quinn", "Ross", "Shaw", "Todd", "Ward", "West", "Wolfe", "Archer", "Brooks", "Chase",
              "Dixon", "Ford", "Green", "Hill", "Lowe", "Marsh", "Porter", "Rhodes", "Sharp", "Tate", "Webb", "Wood",
              "Yates", "Bishop")
OCCUPATIONS = ("glassblower", "cartographer", "beekeeper", "clockmaker", "ferryman", "lamplighter", "weaver",
               "astronomer", "bookbinder", "cooper", "falconer", "tanner", "chandler", "locksmith", "mason",
               "potter", "saddler", "shipwright", "tailor", "vintner", "miller", "herbalist", "engraver", "fletcher")
PETS = ("ferret", "parrot", "tortoise", "goat", "hedgehog", "owl", "rabbit", "lizard", "goose", "donkey", "cat",
        "hound", "raven", "toad", "pony", "canary")
ATTRIBUTES = ("town", "year", "occupation", "pet")
PHRASINGS = {
    "town": ("In which town was {name} born?", "What is the home town of {name}?", "Where was {name} born?"),
    "year": ("In which year was {name} born?", "What is the birth year of {name}?", "When was {name} born?"),
    "occupation": ("What is the occupation of {name}?", "What does {name} do for a living?",
                   "What is {name}'s occupation?"),
    "pet": ("What pet does {name} keep?", "What animal is {name}'s pet?", "Which pet belongs to {name}?"),
}
SYSTEM_PROMPT = (
    "You answer questions about people from a records database. You cannot know the answer yourself: "
    "look the person up first by writing <lookup>FULL NAME</lookup> and stop. The database answers with the "
    "person's record. Then reply with the answer, for example: The answer is ropemaker."
)
# the worked example: a record outside the world, always the same (prompts keep one uid per question text)
EXAMPLE_RECORD = {"name": "Orrin Vail", "town": "Mossbury", "year": 1791, "occupation": "ropemaker", "pet": "heron"}
EXAMPLE_ATTRIBUTE = "occupation"


# ------------------------------------------------------------------------------------------------ records

def syllable_word(rng: random.Random, syllables: int) -> str:
    """An invented capitalised word of `syllables` onset-vowel(-coda) syllables, e.g. 'Velmora'."""
    parts = [rng.choice(ONSETS) + rng.choice(VOWELS) for _ in range(syllables)]
    return ("".join(parts) + rng.choice(CODAS)).capitalize()


def new_record(rng: random.Random, taken: set[str]) -> dict[str, Any]:
    """One fictional person with a name not in `taken` (added to it)."""
    for _ in range(MAX_NAME_DRAWS):
        name = f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"
        if name.lower() not in taken:
            taken.add(name.lower())
            break
    else:
        raise RuntimeError(f"lookup: {MAX_NAME_DRAWS} name draws in a row were taken; lower the number of records")
    return {"name": name, "town": syllable_word(rng, 2), "year": rng.randint(1700, 1999),
            "occupation": rng.choice(OCCUPATIONS), "pet": rng.choice(PETS)}


def build_world(num_records: int = NUM_RECORDS) -> list[dict[str, Any]]:
    """The fixed world: `num_records` people drawn with a seed of their own (not the training seed)."""
    rng = random.Random(f"lookup-world-{EVAL_SEED}-{num_records}")
    taken = {EXAMPLE_RECORD["name"].lower()}
    return [new_record(rng, taken) for _ in range(num_records)]


def split_world(world: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(held-out records, training records): a fixed, seed-independent HELD_OUT_FRACTION of the world."""
    order = list(range(len(world)))
    random.Random(f"lookup-split-{EVAL_SEED}").shuffle(order)
    cut = round(HELD_OUT_FRACTION * len(world))
    return [world[i] for i in sorted(order[:cut])], [world[i] for i in sorted(order[cut:])]


def record_line(record: dict[str, Any]) -> str:
    """What the tool returns for a record."""
    return (f"{record['name']}: born in {record['town']}, year {record['year']}, "
            f"occupation {record['occupation']}, pet {record['pet']}")


def name_key(name: str) -> str:
    """Names match case-insensitively, with spaces collapsed and surrounding quotes/punctuation dropped."""
    return " ".join(name.strip().strip("\"'.,:;").split()).lower()


def find_record(records: list[dict[str, Any]], name: str) -> str:
    """The record line of `name` among `records`; ValueError ('no record named ...') when there is none."""
    wanted = name_key(name)
    if not wanted:
        raise ValueError("empty name; write <lookup>FULL NAME</lookup>")
    for record in records:
        if name_key(record["name"]) == wanted:
            return record_line(record)
    raise ValueError(f"no record named {name.strip()!r}")


def lookup_tool(records: list[dict[str, Any]]) -> Tool:
    """The `lookup` tool over one prompt's records."""
    return Tool(name="lookup", description="returns the record of a person, e.g. <lookup>Orrin Vail</lookup>",
                fn=lambda name: find_record(records, name), params=("name",))


# --------------------------------------------------------------------------------------------------- task

def example_messages() -> list[Message]:
    """One worked exchange: the question, the call, the tool's record, "The answer is ..."."""
    name = EXAMPLE_RECORD["name"]
    return [
        {"role": "user", "content": PHRASINGS[EXAMPLE_ATTRIBUTE][0].format(name=name)},
        {"role": "assistant", "content": f"<lookup>{name}</lookup>"},
        {"role": "tool", "content": record_line(EXAMPLE_RECORD)},
        {"role": "assistant", "content": f"The answer is {EXAMPLE_RECORD[EXAMPLE_ATTRIBUTE]}."},
    ]


class LookupTask(ProceduralTask):
    """Questions asking one attribute of one fictional record (see the module docstring).

    Options: `example` (one worked exchange before the question, default True), `num_records` (world size),
    `distractors` (other records in each prompt's database)."""

    name = "lookup"
    default_reward = "lookup"
    default_env = "lookup"

    def __init__(self, cfg: DataConfig, seed: int, example: bool = True, num_records: int = NUM_RECORDS,
                 distractors: int = DISTRACTORS) -> None:
        super().__init__(cfg, seed)
        if distractors < 0 or num_records * HELD_OUT_FRACTION < distractors + 1:
            raise ValueError(f"task 'lookup': {num_records} records hold out too few for {distractors} distractors "
                             f"per prompt; raise num_records or lower distractors")
        self.example = example
        self.distractors = distractors
        self.world = build_world(num_records)
        self.held_out, self.training = split_world(self.world)
        self._held_names = {name_key(r["name"]) for r in self.held_out}
        self._pool = self.held_out  # the eval split draws from the held-out records only
        self._build_eval_split()
        self._pool = self.training

    def describe(self) -> str:
        return (f"{len(self.world)} fictional records, {len(self.held_out)} held out, "
                f"{len(ATTRIBUTES)} attributes")

    def num_distinct(self) -> int:
        """Distinct question texts over the pool being drawn from (held-out records while building the split)."""
        return len(self._pool) * sum(len(p) for p in PHRASINGS.values())

    def draw(self, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        picked = rng.sample(self._pool, self.distractors + 1)  # the first is asked about
        target, attribute = picked[0], rng.choice(ATTRIBUTES)
        rng.shuffle(picked)
        text = rng.choice(PHRASINGS[attribute]).format(name=target["name"])
        info = {"name": target["name"], "attribute": attribute, "records": [dict(r) for r in picked]}
        return text, str(target[attribute]), info

    def is_held_out(self, text: str, info: dict[str, Any]) -> bool:
        """Split by record: a problem is held out when any record of its database is."""
        return any(name_key(r["name"]) in self._held_names for r in info["records"])

    def prompt(self, text: str, answer: str, info: dict[str, Any], source: str) -> Prompt:
        messages: list[Message] = [{"role": "system", "content": SYSTEM_PROMPT}]
        if self.example:
            messages += example_messages()
        messages.append({"role": "user", "content": text})
        uid = text_uid(self.name, text + ("\x00example" if self.example else ""))
        return Prompt(uid=uid, messages=messages, answer=answer, source=source, info=info)

    def _build_eval_split(self) -> None:
        super()._build_eval_split()
        self._eval = [self.prompt(p.messages[0]["content"], p.answer, p.info, p.source) for p in self._eval]

    def train_prompt(self, position: int) -> Prompt:
        base = super().train_prompt(position)
        return self.prompt(base.messages[0]["content"], base.answer, base.info, base.source)

    def split_summary(self) -> str:
        return (f"task {self.name} ({self.describe()}) -> {len(self._eval)} held-out prompts, split by record "
                f"(no record is in both a training and a held-out prompt)")


def task_options(cfg: DataConfig) -> dict[str, Any]:
    """Keyword options of the task from `data.options` when the config has that table (else none)."""
    return dict(getattr(cfg, "options", None) or {})


def lookup_task(cfg: DataConfig, seed: int) -> LookupTask:
    """Built-in lookup task (see `LookupTask`; registered by name in `rollwise.data.tasks`); options from
    `data.options` when present."""
    try:
        return LookupTask(cfg, seed, **task_options(cfg))
    except TypeError as exc:
        raise ValueError(f"data.options of task 'lookup': {exc} (it takes example, num_records, distractors)") from None


# ------------------------------------------------------------------------------------------------ env

class LookupEnv(ToolEnv):
    """`ToolEnv` whose `lookup` tool reads the prompt's own records (`prompt.info["records"]`)."""

    def __init__(self, parser: str = "tag", max_turns: int = 4, name: str = "lookup", **options: Any) -> None:
        super().__init__([lookup_tool([])], parser, max_turns, name=name, **options)

    def tools_for(self, prompt: Prompt) -> dict[str, Tool]:
        records = prompt.info.get("records")
        if not isinstance(records, list):
            raise ValueError(f"prompt {prompt.source or prompt.uid!r} has no info['records'] for the lookup tool; "
                             f"use data.task = \"lookup\" (or give each row a records list)")
        return {"lookup": lookup_tool(records)}


def lookup_env(cfg: EnvConfig) -> LookupEnv:
    """The `<lookup>NAME</lookup>` tool over each prompt's records (the `lookup` task)."""
    return LookupEnv(cfg.parser, cfg.max_turns, **cfg.options)


# --------------------------------------------------------------------------------------------- reward

ANSWER_PREFIX = re.compile(r"^(?:the\s+)?(?:final\s+)?answer\s*(?:is|:)\s*", re.IGNORECASE)


def normalise_answer(text: str) -> str:
    """Lowercase, spaces collapsed, an 'answer is'/'answer:' prefix, surrounding quotes and end punctuation dropped."""
    text = " ".join(text.strip().split())
    text = ANSWER_PREFIX.sub("", text)
    return text.strip().strip("\"'`*").rstrip(".!").strip().lower()


def lookup_reward(sample: Sample) -> RewardResult:
    """Exact match of the normalised final answer (`normalise_answer`) and the record's attribute."""
    gold = normalise_answer(reference(sample))
    pred = normalise_answer(sample.response_text)
    return verdict(sample, pred == gold, found=bool(pred), answer=pred)
