"""The toy world: a seeded, synthetic multi-hop QA world that a tiny model can learn to search.

It plays the role of wiki-18 plus the seven QA benchmarks at a scale that runs on 2 CPU cores:

* typed entities (countries, cities, people, films, bands, companies) with generated names of a
  few tokens, linked by relations (born in, located in, directed by, founded by, ...) and
  attributes (years);
* one passage per entity in the wiki-18 corpus format (`{"id", "contents": "\"Title\"\\ntext"}`),
  every fact phrased by one fixed sentence template, plus distractor passages that mention the
  same names without holding the facts questions ask about;
* questions in the FlashRAG layout (`qa/<dataset>/<split>.jsonl`, rows `{"id", "question",
  "golden_answers", "metadata"}`) of four hop types: single (1 hop), bridge (2 hops),
  composition (3 hops) and comparison (two look-ups), split into named datasets that mirror the
  seven benchmarks (single-hop group: nq, triviaqa, popqa; multi-hop group: hotpotqa, 2wiki,
  musique, bamboogle). A question never appears in two splits.

Learnability by design: each hop's passage is titled by the entity a query names, the question
contains the words of the first query, and each passage names the next hop's entity verbatim.
`metadata.support` lists the passage id of each hop and `metadata.lookups` the entity looked up
at each hop, which retrieval recall and the scripted demonstrations use.

Determinism: only `random.Random(seed)` is used and all output is written in a fixed order, so
the same config gives byte-identical files.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from a2tgpo.config import SEED_LIMIT, InvalidKey, file_name_error, option
from a2tgpo.io import atomic_path, atomic_write_json

HopType = Literal["single", "bridge", "composition", "comparison"]
HOP_TYPES: tuple[str, ...] = ("single", "bridge", "composition", "comparison")


@dataclass(frozen=True)
class QASetSpec:
    """One named question set (the toy stand-in for one benchmark)."""

    name: str = option(doc="Dataset name; the folder under qa/ (e.g. toy_nq).")
    group: Literal["single_hop", "multi_hop"] = option(doc="Benchmark group it belongs to.")
    splits: dict[str, int] = option(doc="Questions per split, e.g. {train: 300, dev: 50}.", ge=0)
    mix: dict[str, float] = option(
        doc="Fraction of each hop type (single, bridge, composition, comparison); sums to 1.",
        ge=0, le=1
    )

    def __post_init__(self) -> None:
        if error := file_name_error(self.name):  # the folder qa/<name>/
            raise InvalidKey("name", error)
        bad = sorted(set(self.mix) - set(HOP_TYPES))
        if bad:
            raise ValueError(f"qa set {self.name}: unknown hop types {bad}; valid: {HOP_TYPES}")
        if abs(sum(self.mix.values()) - 1.0) > 1e-9:
            raise ValueError(f"qa set {self.name}: mix fractions sum to {sum(self.mix.values())}")
        if any(n < 0 for n in self.splits.values()) or any(f < 0 for f in self.mix.values()):
            raise ValueError(f"qa set {self.name}: sizes and fractions must be >= 0")


def _default_sets() -> tuple[QASetSpec, ...]:
    single = {"single": 1.0}
    return (
        QASetSpec("toy_nq", "single_hop", {"train": 300, "dev": 50, "test": 80}, single),
        QASetSpec("toy_triviaqa", "single_hop", {"test": 80}, single),
        QASetSpec("toy_popqa", "single_hop", {"test": 80}, single),
        QASetSpec("toy_hotpotqa", "multi_hop", {"train": 300, "dev": 80},
                  {"bridge": 0.8, "comparison": 0.2}),
        QASetSpec("toy_2wikimultihopqa", "multi_hop", {"dev": 80},
                  {"bridge": 0.4, "composition": 0.3, "comparison": 0.3}),
        QASetSpec("toy_musique", "multi_hop", {"dev": 60}, {"bridge": 0.3, "composition": 0.7}),
        QASetSpec("toy_bamboogle", "multi_hop", {"test": 40}, {"bridge": 0.5, "composition": 0.5}),
    )


@dataclass(frozen=True)
class WorldConfig:
    """Sizes and seed of the toy world (`a2tgpo world`)."""

    seed: int = option(0, "Random seed; the same seed and sizes give byte-identical files.", ge=0,
                       lt=SEED_LIMIT)
    countries: int = option(10, "Number of countries.", ge=1)
    cities: int = option(40, "Number of cities (each located in a country).", ge=1)
    people: int = option(150, "Number of people (born in a city, in a year; work for a company).",
                         ge=1)
    films: int = option(80, "Number of films (directed by a person, released in a year).", ge=1)
    bands: int = option(30, "Number of bands (formed in a city, founded by a person, in a year).",
                        ge=1)
    companies: int = option(40, "Number of companies (headquarters city, founder, year).", ge=1)
    distractors: int = option(
        80, "Distractor passages (events) that mention names but hold no asked-about fact.", ge=0
    )
    first_year: int = option(1900, "Earliest year of any dated fact.")
    last_year: int = option(1999, "Latest year of any dated fact.")
    qa_sets: tuple[QASetSpec, ...] = option(
        doc="The named question sets and their splits.", factory=_default_sets
    )

    def __post_init__(self) -> None:
        for key in ("countries", "cities", "people", "films", "bands", "companies"):
            if getattr(self, key) < 2:
                raise ValueError(f"{key} must be >= 2")
        if self.cities < self.countries:
            raise ValueError("cities must be >= countries (every country needs a capital)")
        if self.last_year - self.first_year < 10:
            raise ValueError("last_year - first_year must be >= 10")
        names = [s.name for s in self.qa_sets]
        if len(set(names)) != len(names):
            raise ValueError(f"qa_sets: duplicate names in {names}")


# --------------------------------------------------------------------------------------------
# names: short, pronounceable, unique; real words for titles so the encoder has something to hold

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr",
           "st", "tr", "kr", "gl", "h", "j", "sh", "th"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "io", "ou"]
_CODAS = ["", "", "", "n", "r", "l", "s", "m", "k", "th", "nd", "rt"]
_CITY_SUFFIX = ["ton", "ville", "burg", "port", "ford", "field", "haven", "dale"]
_COUNTRY_SUFFIX = ["ia", "land", "ora", "istan", "ania", "eth"]
_COMPANY_SUFFIX = ["Industries", "Systems", "Motors", "Foods", "Labs", "Records", "Airlines",
                   "Textiles", "Media", "Energy"]
_ADJECTIVES = ["Silent", "Golden", "Broken", "Hidden", "Last", "Crimson", "Frozen", "Distant",
               "Endless", "Hollow", "Burning", "Quiet", "Wild", "Lonely", "Bright", "Dark",
               "Lost", "Iron", "Velvet", "Paper", "Electric", "Bitter", "Secret", "Northern",
               "Falling", "Sleeping", "Painted", "Wandering", "Stolen", "Glass"]
_NOUNS = ["Harbor", "River", "Garden", "Mountain", "Letter", "Window", "Empire", "Station",
          "Island", "Forest", "Mirror", "Promise", "Journey", "Crown", "Shadow", "Bridge",
          "Valley", "Lantern", "Horizon", "Orchard", "Winter", "Summer", "Castle", "Road",
          "Ocean", "Desert", "Tower", "Compass", "Voyage", "Meadow"]
_BAND_NOUNS = ["Wolves", "Ravens", "Sparks", "Tigers", "Echoes", "Strangers", "Pilots",
               "Foxes", "Saints", "Rebels", "Giants", "Comets", "Lions", "Owls", "Drifters"]
_EVENTS = ["Festival", "Marathon", "Book Fair", "Film Week", "Music Awards", "Science Expo",
           "Jazz Night", "Trade Show", "Chess Open", "Art Biennale"]


def _syllable(rng: random.Random, coda: bool = True) -> str:
    return rng.choice(_ONSETS) + rng.choice(_VOWELS) + (rng.choice(_CODAS) if coda else "")


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(_syllable(rng, coda=i == syllables - 1) for i in range(syllables)).capitalize()


class _Namer:
    """Draws unique names (case-insensitive) from per-type generators."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: set[str] = set()

    def unique(self, make) -> str:
        for _ in range(10_000):
            name = make()
            if name.lower() not in self.used:
                self.used.add(name.lower())
                return name
        raise RuntimeError("ran out of unique names; lower the world sizes")

    def person(self) -> str:
        return self.unique(lambda: f"{_word(self.rng, 2)} {_word(self.rng, 2)}")

    def city(self) -> str:
        return self.unique(lambda: _word(self.rng, 1) + self.rng.choice(_CITY_SUFFIX))

    def country(self) -> str:
        return self.unique(
            lambda: _word(self.rng, 1) + self.rng.choice(_COUNTRY_SUFFIX)
        )

    def film(self) -> str:
        return self.unique(
            lambda: f"The {self.rng.choice(_ADJECTIVES)} {self.rng.choice(_NOUNS)}"
        )

    def band(self) -> str:
        return self.unique(
            lambda: f"The {self.rng.choice(_ADJECTIVES)} {self.rng.choice(_BAND_NOUNS)}"
        )

    def company(self) -> str:
        return self.unique(lambda: f"{_word(self.rng, 2)} {self.rng.choice(_COMPANY_SUFFIX)}")


# --------------------------------------------------------------------------------------------
# entities and passages


@dataclass
class Entity:
    id: str
    type: str
    name: str
    aliases: list[str]
    attrs: dict[str, int] = dataclasses.field(default_factory=dict)
    rels: dict[str, str] = dataclasses.field(default_factory=dict)  # relation -> entity id
    passage_id: str = ""


@dataclass(frozen=True)
class Question:
    question: str
    answers: tuple[str, ...]
    hop_type: str
    hops: int
    support: tuple[str, ...]  # passage id per hop, in order
    lookups: tuple[str, ...]  # entity name looked up per hop


class World:
    """Entities, passages and the candidate questions of one seeded world."""

    def __init__(self, cfg: WorldConfig):
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.entities: dict[str, Entity] = {}
        self.passages: list[dict] = []
        self._build_entities()
        self._build_passages()

    # -- entities ---------------------------------------------------------------------------

    def _add(self, type_: str, name: str, aliases: list[str]) -> Entity:
        e = Entity(id=f"{type_}:{len(self.of(type_))}", type=type_, name=name, aliases=aliases)
        self.entities[e.id] = e
        return e

    def of(self, type_: str) -> list[Entity]:
        return [e for e in self.entities.values() if e.type == type_]

    def _year(self) -> int:
        return self.rng.randint(self.cfg.first_year, self.cfg.last_year)

    def _build_entities(self) -> None:
        cfg, rng, namer = self.cfg, self.rng, _Namer(self.rng)
        countries = [self._add("country", namer.country(), []) for _ in range(cfg.countries)]
        cities = []
        for i in range(cfg.cities):
            city = self._add("city", namer.city(), [])
            # round-robin first so every country has at least one city (its capital)
            country = countries[i] if i < len(countries) else rng.choice(countries)
            city.rels["country"] = country.id
            cities.append(city)
        for c in countries:
            c.rels["capital"] = next(x.id for x in cities if x.rels["country"] == c.id)
        people = []
        for _ in range(cfg.people):
            name = namer.person()
            p = self._add("person", name, [name.split()[-1]])
            p.rels["born_in"] = rng.choice(cities).id
            p.attrs["birth_year"] = self._year()
            people.append(p)
        companies = []
        for _ in range(cfg.companies):
            name = namer.company()
            co = self._add("company", name, [name.rsplit(" ", 1)[0]])
            co.rels["headquarters"] = rng.choice(cities).id
            co.rels["founder"] = rng.choice(people).id
            co.attrs["founded"] = self._year()
            companies.append(co)
        for p in people:
            p.rels["employer"] = rng.choice(companies).id
        for _ in range(cfg.films):
            f = self._add("film", namer.film(), [])
            f.rels["director"] = rng.choice(people).id
            f.attrs["released"] = self._year()
        for _ in range(cfg.bands):
            b = self._add("band", namer.band(), [])
            b.rels["origin"] = rng.choice(cities).id
            b.rels["founder"] = rng.choice(people).id
            b.attrs["formed"] = self._year()

    def name(self, eid: str) -> str:
        return self.entities[eid].name

    # -- passages ---------------------------------------------------------------------------

    def _facts(self, e: Entity) -> list[str]:
        n, r, a = e.name, e.rels, e.attrs
        if e.type == "country":
            return [f"{n} is a country.", f"The capital of {n} is {self.name(r['capital'])}."]
        if e.type == "city":
            return [f"{n} is a city.", f"{n} is located in {self.name(r['country'])}."]
        if e.type == "person":
            return [f"{n} is a person.", f"{n} was born in {self.name(r['born_in'])}.",
                    f"{n} was born in the year {a['birth_year']}.",
                    f"{n} works for {self.name(r['employer'])}."]
        if e.type == "company":
            return [f"{n} is a company.",
                    f"{n} is headquartered in {self.name(r['headquarters'])}.",
                    f"{n} was founded by {self.name(r['founder'])}.",
                    f"{n} was founded in the year {a['founded']}."]
        if e.type == "film":
            return [f"{n} is a film.", f"{n} was directed by {self.name(r['director'])}.",
                    f"{n} was released in the year {a['released']}."]
        if e.type == "band":
            return [f"{n} is a band.", f"{n} was formed in {self.name(r['origin'])}.",
                    f"{n} was founded by {self.name(r['founder'])}.",
                    f"{n} was formed in the year {a['formed']}."]
        raise AssertionError(e.type)

    def _build_passages(self) -> None:
        for e in self.entities.values():
            e.passage_id = str(len(self.passages))
            text = " ".join(self._facts(e))
            self.passages.append({"id": e.passage_id, "contents": f'"{e.name}"\n{text}'})
        cities, people = self.of("city"), self.of("person")
        titles: set[str] = set()
        while len(titles) < min(self.cfg.distractors, len(cities) * len(_EVENTS)):
            city, event = self.rng.choice(cities).name, self.rng.choice(_EVENTS)
            title = f"{city} {event}"
            if title in titles:
                continue
            titles.add(title)
            a, b = self.rng.sample(people, 2)
            text = (f"The {title} is an annual event held in {city}. {a.name} and {b.name} "
                    f"attended the {title} in the year {self._year()}.")
            self.passages.append({"id": str(len(self.passages)), "contents": f'"{title}"\n{text}'})

    # -- questions --------------------------------------------------------------------------

    def _answers(self, eid: str) -> tuple[str, ...]:
        e = self.entities[eid]
        return (e.name, *e.aliases)

    def _q(self, text: str, answer, hop_type: str, path: list[Entity]) -> Question:
        answers = (str(answer),) if isinstance(answer, int) else self._answers(answer)
        return Question(text, answers, hop_type, len(path),
                        tuple(e.passage_id for e in path), tuple(e.name for e in path))

    def candidates(self) -> dict[str, list[Question]]:
        """All questions the world supports, by hop type, in a fixed order."""
        E = self.entities
        out: dict[str, list[Question]] = {h: [] for h in HOP_TYPES}
        single, bridge, comp = out["single"], out["bridge"], out["composition"]
        for c in self.of("country"):
            single.append(self._q(f"What is the capital of {c.name}?", c.rels["capital"],
                                  "single", [c]))
        for c in self.of("city"):
            single.append(self._q(f"In which country is {c.name} located?", c.rels["country"],
                                  "single", [c]))
        for p in self.of("person"):
            city, emp = E[p.rels["born_in"]], E[p.rels["employer"]]
            country = E[city.rels["country"]]
            single += [
                self._q(f"Where was {p.name} born?", city.id, "single", [p]),
                self._q(f"In what year was {p.name} born?", p.attrs["birth_year"], "single", [p]),
                self._q(f"Which company does {p.name} work for?", emp.id, "single", [p]),
            ]
            bridge += [
                self._q(f"In which country was {p.name} born?", country.id, "bridge", [p, city]),
                self._q(f"Who founded the company that {p.name} works for?", emp.rels["founder"],
                        "bridge", [p, emp]),
            ]
            comp.append(self._q(f"What is the capital of the country where {p.name} was born?",
                                country.rels["capital"], "composition", [p, city, country]))
        for co in self.of("company"):
            hq, founder = E[co.rels["headquarters"]], E[co.rels["founder"]]
            born = E[founder.rels["born_in"]]
            single += [
                self._q(f"Where is {co.name} headquartered?", hq.id, "single", [co]),
                self._q(f"Who founded {co.name}?", founder.id, "single", [co]),
            ]
            bridge += [
                self._q(f"In which country is {co.name} headquartered?", hq.rels["country"],
                        "bridge", [co, hq]),
                self._q(f"In what year was the founder of {co.name} born?",
                        founder.attrs["birth_year"], "bridge", [co, founder]),
            ]
            comp.append(self._q(f"In which country was the founder of {co.name} born?",
                                born.rels["country"], "composition", [co, founder, born]))
        for f in self.of("film"):
            d = E[f.rels["director"]]
            born = E[d.rels["born_in"]]
            single += [
                self._q(f"Who directed {f.name}?", d.id, "single", [f]),
                self._q(f"In what year was {f.name} released?", f.attrs["released"], "single", [f]),
            ]
            bridge += [
                self._q(f"Where was the director of {f.name} born?", born.id, "bridge", [f, d]),
                self._q(f"In what year was the director of {f.name} born?",
                        d.attrs["birth_year"], "bridge", [f, d]),
            ]
            comp.append(self._q(f"In which country was the director of {f.name} born?",
                                born.rels["country"], "composition", [f, d, born]))
        for b in self.of("band"):
            origin, founder = E[b.rels["origin"]], E[b.rels["founder"]]
            born = E[founder.rels["born_in"]]
            single += [
                self._q(f"Where was {b.name} formed?", origin.id, "single", [b]),
                self._q(f"Who founded {b.name}?", founder.id, "single", [b]),
            ]
            bridge += [
                self._q(f"In which country was {b.name} formed?", origin.rels["country"],
                        "bridge", [b, origin]),
                self._q(f"Where was the founder of {b.name} born?", born.id, "bridge",
                        [b, founder]),
            ]
            comp.append(self._q(f"In which country was the founder of {b.name} born?",
                                born.rels["country"], "composition", [b, founder, born]))
        out["comparison"] = self._comparisons()
        return out

    def _comparisons(self) -> list[Question]:
        """Pairs with distinct years; the answer is the earlier one's name."""
        kinds = [("person", "birth_year", "Who was born first, {a} or {b}?"),
                 ("film", "released", "Which film was released first, {a} or {b}?"),
                 ("company", "founded", "Which company was founded first, {a} or {b}?"),
                 ("band", "formed", "Which band was formed first, {a} or {b}?")]
        out = []
        for type_, attr, template in kinds:
            items = self.of(type_)
            order = list(range(len(items)))
            self.rng.shuffle(order)
            # pair consecutive items of a shuffled order: each entity in at most one pair
            # (strict=False: with an odd count the last item is left unpaired)
            for i, j in zip(order[::2], order[1::2], strict=False):
                a, b = items[i], items[j]
                if a.attrs[attr] == b.attrs[attr]:
                    continue
                first = a if a.attrs[attr] < b.attrs[attr] else b
                out.append(Question(template.format(a=a.name, b=b.name), self._answers(first.id),
                                    "comparison", 2, (a.passage_id, b.passage_id),
                                    (a.name, b.name)))
        return out


# --------------------------------------------------------------------------------------------
# splits and files


def _allocate(spec: QASetSpec, n: int) -> dict[str, int]:
    """Split n questions over hop types by the mix (largest remainder, ties in HOP_TYPES order)."""
    raw = {h: spec.mix.get(h, 0.0) * n for h in HOP_TYPES}
    counts = {h: int(v) for h, v in raw.items()}
    rest = n - sum(counts.values())
    for h in sorted(HOP_TYPES, key=lambda h: -(raw[h] - counts[h]))[:rest]:
        counts[h] += 1
    return counts


def generate_world(cfg: WorldConfig) -> tuple[World, dict[str, dict[str, list[dict]]]]:
    """Build the world and draw every QA set's splits without replacement."""
    world = World(cfg)
    pools = world.candidates()
    for h in HOP_TYPES:
        world.rng.shuffle(pools[h])
    taken = Counter()
    qa: dict[str, dict[str, list[dict]]] = {}
    for spec in cfg.qa_sets:
        qa[spec.name] = {}
        for split, n in spec.splits.items():
            rows = []
            for h, k in _allocate(spec, n).items():
                if taken[h] + k > len(pools[h]):
                    raise ValueError(
                        f"world: not enough distinct {h} questions for {spec.name}/{split} "
                        f"({len(pools[h])} exist, {taken[h] + k} requested so far); "
                        "increase the entity counts or lower qa_sets sizes"
                    )
                rows += pools[h][taken[h]: taken[h] + k]
                taken[h] += k
            world.rng.shuffle(rows)
            qa[spec.name][split] = [
                {
                    "id": f"{split}_{i}",
                    "question": q.question,
                    "golden_answers": list(q.answers),
                    "metadata": {"hop_type": q.hop_type, "hops": q.hops,
                                 "support": list(q.support), "lookups": list(q.lookups)},
                }
                for i, q in enumerate(rows)
            ]
    return world, qa


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def write_world(cfg: WorldConfig, out_dir: str | Path) -> dict:
    """Generate the world and write it under `out_dir`:

    corpus.jsonl (wiki-18 format), entities.jsonl, qa/<dataset>/<split>.jsonl (FlashRAG layout)
    and summary.json (written last: its presence means the world is complete).
    """
    out = Path(out_dir)
    world, qa = generate_world(cfg)
    _write_jsonl(out / "corpus.jsonl", world.passages)
    _write_jsonl(out / "entities.jsonl", [dataclasses.asdict(e) for e in world.entities.values()])
    counts: dict[str, dict[str, dict[str, int]]] = {}
    for name, splits in qa.items():
        counts[name] = {}
        for split, rows in splits.items():
            _write_jsonl(out / "qa" / name / f"{split}.jsonl", rows)
            by_type = Counter(r["metadata"]["hop_type"] for r in rows)
            counts[name][split] = {h: by_type.get(h, 0) for h in HOP_TYPES}
    summary = {
        "seed": cfg.seed,
        "passages": len(world.passages),
        "entity_passages": len(world.entities),
        "distractor_passages": len(world.passages) - len(world.entities),
        "entities": dict(Counter(e.type for e in world.entities.values())),
        "groups": {s.name: s.group for s in cfg.qa_sets},
        "questions": counts,
    }
    atomic_write_json(out / "summary.json", summary)
    return summary


def print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    ents = ", ".join(f"{n} {t}" for t, n in summary["entities"].items())
    console.print(f"[bold]toy world[/] seed {summary['seed']}: {summary['passages']} passages "
                  f"({summary['distractor_passages']} distractors); entities: {ents}")
    table = Table("dataset", "group", "split", *HOP_TYPES, "total")
    for name, splits in summary["questions"].items():
        for split, c in splits.items():
            table.add_row(name, summary["groups"][name], split, *(str(c[h]) for h in HOP_TYPES),
                          str(sum(c.values())))
    console.print(table)
