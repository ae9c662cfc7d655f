"""Write the small test fixtures under ``tests/data/`` (deterministic: running it again rewrites
the same bytes).  Every sentence, name and entity id is invented here; only the *formats* follow
the public data sets (see README.md beside this file).

    .venv/bin/python tests/data/make_fixtures.py            # rewrite every fixture
    .venv/bin/python tests/data/make_fixtures.py fewrel     # only some (names: see WRITERS)

Each data set has its own writer function; keep them separate so that they can be regenerated
one at a time.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8", newline="\n")


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _dump_object(mapping: dict[str, Any]) -> str:
    """A JSON object with one key per line (stable, diff-friendly)."""
    return "{\n" + ",\n".join(f"{_dump(k)}: {_dump(v)}" for k, v in mapping.items()) + "\n}\n"


# =========================================================================== FewRel + CoDEx-M
#
# FewRel (val_wiki.json): {relation id: [{"tokens": [...], "h": [name, qid, [[idx, ...]]],
# "t": [name, qid, [[idx, ...]]]}, ...]}; pid2name.json: {relation id: [name, description]}.
# CoDEx-M: train/valid/test.txt with head<TAB>property<TAB>tail Q-id triples; entity2types.json
# {qid: [type qid, ...]}; relations_en.json {pid: {"label": ..., "description": ...}}.
#
# 8 invented relations x 15 instances: 12 well-formed subject-first sentences (so a limit of
# 10 per relation also leaves an ``over_limit`` skip), one object-first, one where head and tail
# share tokens, and one of malformed / invalid_span / empty_prompt / subject_not_in_prompt in
# turn.  Some well-formed sentences carry FewRel's blank tokens ("\xa0").  The CoDEx fixture
# holds triples about the FewRel fixture's own entity ids: for a share of the instances that
# differs per relation (none at all for one relation) both entities are in the graph, with a
# varying number of shared properties; plus entities that FewRel never mentions.

FEWREL_SEED = 1307
N_VALID = 12
SYLLABLES = (
    "ka",
    "lo",
    "mer",
    "ti",
    "van",
    "or",
    "sel",
    "bru",
    "den",
    "as",
    "qui",
    "rho",
    "ne",
    "tam",
    "vi",
    "gor",
    "el",
    "pa",
    "zun",
    "dri",
    "ho",
    "mel",
    "ost",
    "ra",
)


def _name(rng: random.Random, used: set[str], parts: int = 2) -> str:
    """A new invented capitalised word of ``parts`` syllables (or more, if they run out)."""
    while True:
        word = "".join(rng.choice(SYLLABLES) for _ in range(parts)).capitalize()
        if word not in used:
            used.add(word)
            return word
        parts += rng.random() < 0.1


# relation id -> (name, description, subject kind, object kind, subject-first templates, object-first template)
# {s} and {o} mark the head and tail; {x} is a filler name, {y} a year.  Tokens are split on spaces.
RELATIONS: dict[str, tuple[str, str, str, str, tuple[str, ...], str]] = {
    "P177": (
        "crosses",
        "what a bridge or tunnel passes over or under (invented fixture text)",
        "bridge",
        "river",
        (
            "The {s} crosses the {o} south of {x} .",
            "Opened in {y} , the {s} spans the {o} .",
            "{s} carries a railway over the {o} near {x} .",
            "Engineers in {x} rebuilt the {s} over the {o} in {y} .",
        ),
        "The {o} is crossed by the {s} near {x} .",
    ),
    "P206": (
        "located in or next to body of water",
        "the lake, sea or river a place lies on (invented)",
        "town",
        "lake",
        (
            "{s} is a fishing town on the shore of {o} .",
            "The harbour of {s} opens onto {o} .",
            "In {y} the village of {s} , beside {o} , was flooded .",
            "Ferries leave {s} every hour for the far side of {o} .",
        ),
        "On the east side of {o} lies the port of {s} .",
    ),
    "P641": (
        "sport",
        "the sport a person or team takes part in (invented)",
        "person",
        "sport",
        (
            "{s} is a professional {o} player from {x} .",
            "Born in {y} , {s} won three national titles in {o} .",
            "After leaving school {s} took up {o} at {x} .",
            "The coach of {s} says that {o} suits a patient mind .",
        ),
        "The {o} champion {s} retired in {y} .",
    ),
    "P26": (
        "spouse",
        "the person someone is married to (invented)",
        "person",
        "person",
        (
            "{s} married {o} in {y} .",
            "In {x} , {s} met {o} , whom she married a year later .",
            "The writer {s} and her husband {o} lived in {x} .",
            "{s} was widowed when {o} died in {y} .",
        ),
        "In {y} {o} , the wife of {s} , opened a school in {x} .",
    ),
    "P25": (
        "mother",
        "the female parent of a person (invented)",
        "person",
        "person",
        (
            "{s} was the eldest son of {o} .",
            "Raised in {x} , {s} was taught to read by his mother {o} .",
            "According to the parish record , {s} was born in {y} to {o} .",
            "{s} dedicated his first novel to {o} , his mother .",
        ),
        "In {y} {o} gave birth to {s} in {x} .",
    ),
    "P463": (
        "member of",
        "an organisation or club someone belongs to (invented)",
        "band",
        "org",
        (
            "{s} joined the {o} in {y} .",
            "Since {y} the band {s} has been a member of the {o} .",
            "{s} was admitted to the {o} after a vote in {x} .",
            "{s} left the {o} in a dispute over fees .",
        ),
        "The {o} counts {s} among its founders .",
    ),
    "P364": (
        "original language of film or TV show",
        "the language a film was first made in (invented)",
        "film",
        "language",
        (
            "{s} is a {y} drama film shot in {o} .",
            "The comedy {s} was written and filmed in {o} .",
            "Directed in {x} , {s} was released in {y} in {o} .",
            "{s} , a thriller from {y} , was dubbed from {o} .",
        ),
        "Most {o} cinema of the decade , like {s} , was silent .",
    ),
    "P921": (
        "main subject",
        "the main topic of a written work (invented)",
        "book",
        "topic",
        (
            "{s} is a short book about {o} .",
            "Published in {y} , {s} studies {o} in the valleys of {x} .",
            "The essay {s} argues that {o} shaped the town of {x} .",
            "Critics praised {s} for its account of {o} .",
        ),
        "A history of {o} , {s} appeared in {y} .",
    ),
}
OBJECT_POOL = {"river": 6, "lake": 4, "sport": 3, "person": 12, "org": 5, "language": 3, "topic": 7}
SPORTS = ("hurling", "rowing", "fencing")
TOPICS = (
    "salt trade",
    "river fishing",
    "glass making",
    "the copper mines",
    "village dialects",
    "sheep farming",
    "the old railway",
)
# Share of each relation's well-formed instances whose subject and object are both in the CoDEx fixture.
KG_SHARE = {
    "P177": 0.5,
    "P206": 0.25,
    "P641": 0.0,
    "P26": 0.75,
    "P25": 0.5,
    "P463": 0.33,
    "P364": 0.25,
    "P921": 0.6,
}
KG_PROPERTIES = ("P17", "P31", "P131", "P27", "P495", "P106", "P361", "P1412", "P136", "P279")


class _Entities:
    """Invented entities: name -> Q-id (ids from Q9100001 up, clearly outside the data sets used here)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set()
        self.qid: dict[str, str] = {}
        self.kind: dict[str, str] = {}

    def add(self, name: str, kind: str) -> str:
        if name not in self.qid:
            self.qid[name] = f"Q{9100001 + len(self.qid)}"
            self.kind[name] = kind
        return name

    def make(self, kind: str) -> str:
        rng = self.rng
        if kind == "bridge":
            base = f"{_name(rng, self.used)} Bridge"
        elif kind == "river":
            base = f"{_name(rng, self.used)} River"
        elif kind == "lake":
            base = f"Lake {_name(rng, self.used)}"
        elif kind == "town":
            base = _name(rng, self.used, 3)
        elif kind == "person":
            base = f"{_name(rng, self.used)} {_name(rng, self.used, 3)}"
        elif kind == "band":
            base = f"The {_name(rng, self.used)} Singers" if rng.random() < 0.5 else _name(rng, self.used, 3)
        elif kind == "org":
            base = f"{_name(rng, self.used)} Music Guild"
        elif kind == "film":
            base = f"{_name(rng, self.used)} {_name(rng, self.used)}"
        elif kind == "book":
            base = f"On {_name(rng, self.used, 3)}"
        elif kind == "language":
            base = f"{_name(rng, self.used)}ish"
        else:
            raise ValueError(kind)
        return self.add(base, kind)


def _objects(ents: _Entities, kind: str) -> list[str]:
    if kind == "sport":
        return [ents.add(s, "sport") for s in SPORTS]
    if kind == "topic":
        return [ents.add(s, "topic") for s in TOPICS]
    return [ents.make(kind) for _ in range(OBJECT_POOL[kind])]


def _fill(
    template: str, s: str, o: str, rng: random.Random, ents: _Entities
) -> tuple[list[str], list[int], list[int]]:
    """Tokens of the filled template and the token indices of the head and the tail."""
    tokens: list[str] = []
    head: list[int] = []
    tail: list[int] = []
    for word in template.split(" "):
        if word == "{s}":
            head = list(range(len(tokens), len(tokens) + len(s.split(" "))))
            tokens += s.split(" ")
        elif word == "{o}":
            tail = list(range(len(tokens), len(tokens) + len(o.split(" "))))
            tokens += o.split(" ")
        elif word == "{x}":
            tokens.append(_name(rng, ents.used, 3))
        elif word == "{y}":
            tokens.append(str(rng.randint(1820, 1990)))
        else:
            tokens.append(word)
    return tokens, head, tail


def _instance(
    tokens: list[str], s: str, o: str, ents: _Entities, head: list[int], tail: list[int]
) -> dict[str, Any]:
    return {"tokens": tokens, "h": [s.lower(), ents.qid[s], [head]], "t": [o.lower(), ents.qid[o], [tail]]}


def _odd_instance(which: str, s: str, o: str, ents: _Entities) -> dict[str, Any]:
    """One instance that the loader must skip for the reason ``which``."""
    if which == "malformed":  # the tail's occurrence list is empty
        inst = _instance(["The", *s.split(" "), "is", "near", *o.split(" "), "."], s, o, ents, [1], [])
        inst["t"][2] = []
        return inst
    if which == "invalid_span":  # a tail index past the end of the sentence
        toks = ["Records", "about", *s.split(" "), "mention", *o.split(" "), "."]
        return _instance(toks, s, o, ents, [2], [len(toks) + 3])
    if which == "empty_prompt":  # only blank tokens (the head) before the tail
        toks = ["\xa0", *o.split(" "), "appears", "in", "the", "record", "."]
        return _instance(toks, s, o, ents, [0], [1])
    if which == "subject_not_in_prompt":  # the head's only token is blank
        toks = ["In", "\xa0", "the", "notes", ",", *o.split(" "), "is", "listed", "."]
        return _instance(toks, s, o, ents, [1], [5])
    raise ValueError(which)


def fewrel_instances(
    rng: random.Random, ents: _Entities
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[tuple[str, str]]]]:
    """The FewRel fixture and, per relation, its well-formed (subject, object) pairs in file order."""
    odd = ("malformed", "invalid_span", "empty_prompt", "subject_not_in_prompt")
    data: dict[str, list[dict[str, Any]]] = {}
    pairs: dict[str, list[tuple[str, str]]] = {}
    for r, (pid, (_, _, skind, okind, templates, obj_first)) in enumerate(RELATIONS.items()):
        objects = _objects(ents, okind)
        rows: list[tuple[dict[str, Any], tuple[str, str] | None]] = []
        for i in range(N_VALID + 2):
            s = ents.make(skind)
            o = rng.choice([x for x in objects if x != s])
            if i < N_VALID:
                toks, h, t = _fill(templates[i % len(templates)], s, o, rng, ents)
                if i % 5 == 3:  # a blank token, as about 2% of real FewRel sentences hold
                    at = rng.randrange(1, min(h[0], t[0])) if min(h[0], t[0]) > 1 else len(toks) - 1
                    toks.insert(at, "\xa0")
                    h = [j + (j >= at) for j in h]
                    t = [j + (j >= at) for j in t]
                rows.append((_instance(toks, s, o, ents, h, t), (s, o)))
            elif i == N_VALID:
                toks, h, t = _fill(obj_first, s, o, rng, ents)
                rows.append((_instance(toks, s, o, ents, h, t), None))
            else:  # head and tail share a token
                toks, h, t = _fill(templates[0], s, o, rng, ents)
                rows.append((_instance(toks, s, o, ents, h, [h[-1], *t]), None))
        s = ents.make(skind)
        rows.append((_odd_instance(odd[r % len(odd)], s, rng.choice(objects), ents), None))
        rng.shuffle(rows)
        data[pid] = [inst for inst, _ in rows]
        pairs[pid] = [p for _, p in rows if p is not None]
    return data, pairs


def codex_triples(
    rng: random.Random, ents: _Entities, pairs: dict[str, list[tuple[str, str]]]
) -> list[tuple[str, str, str]]:
    """Triples about the FewRel fixture's entities (a share KG_SHARE of each relation's pairs
    covered) plus other invented entities."""
    q = ents.qid
    triples: list[tuple[str, str, str]] = []
    others = [ents.make("town") for _ in range(12)]
    covered: set[str] = set()
    for pid, plist in pairs.items():
        n = round(KG_SHARE[pid] * len(plist))
        for k, (s, o) in enumerate(rng.sample(plist, len(plist))):
            if k >= n:
                break
            shared = rng.sample(KG_PROPERTIES, rng.randint(0, 3))
            for ent in (s, o):
                props = set(shared) | set(rng.sample(KG_PROPERTIES, rng.randint(0, 2)))
                if ent in covered:
                    props = set(shared)
                for p in sorted(props):
                    triples.append((q[ent], p, q[rng.choice(others)]))
                covered.add(ent)
            if rng.random() < 0.5 or not shared:
                triples.append((q[s], pid, q[o]))  # the FewRel fact itself, sometimes
    for a in others:  # the rest of the graph: entities FewRel never mentions
        for _ in range(rng.randint(1, 4)):
            b = rng.choice(others)
            if b != a:
                triples.append((q[a], rng.choice(KG_PROPERTIES), q[b]))
    unique = sorted(set(triples))
    rng.shuffle(unique)
    return unique


def write_fewrel_and_codex(root: Path = HERE) -> None:
    """tests/data/fewrel/{val_wiki,pid2name}.json and tests/data/codex_m/*."""
    rng = random.Random(FEWREL_SEED)
    ents = _Entities(rng)
    data, pairs = fewrel_instances(rng, ents)
    body = ",\n".join(
        f"{_dump(pid)}: [\n" + ",\n".join(" " + _dump(i) for i in insts) + "\n]"
        for pid, insts in data.items()
    )
    _write_text(root / "fewrel" / "val_wiki.json", "{\n" + body + "\n}\n")
    names = {pid: [v[0], v[1]] for pid, v in RELATIONS.items()}
    names["P9999"] = ["unused fixture relation", "listed in pid2name.json but absent from val_wiki.json"]
    _write_text(root / "fewrel" / "pid2name.json", _dump_object(names))

    triples = codex_triples(rng, ents, pairs)
    n = len(triples)
    splits = {
        "train": triples[: n * 8 // 10],
        "valid": triples[n * 8 // 10 : n * 9 // 10],
        "test": triples[n * 9 // 10 :],
    }
    for split, rows in splits.items():
        _write_text(root / "codex_m" / f"{split}.txt", "".join(f"{h}\t{p}\t{t}\n" for h, p, t in rows))
    by_qid = {qid: name for name, qid in ents.qid.items()}
    kinds = sorted(set(ents.kind.values()))
    type_qid = {k: f"Q{9190001 + i}" for i, k in enumerate(kinds)}
    in_graph = sorted({e for h, _, t in triples for e in (h, t)}, key=lambda x: int(x[1:]))
    _write_text(
        root / "codex_m" / "entity2types.json",
        _dump_object({e: [type_qid[ents.kind[by_qid[e]]]] for e in in_graph}),
    )
    props = sorted({p for _, p, _ in triples}, key=lambda x: int(x[1:]))
    labels = {
        p: {
            "label": RELATIONS[p][0] if p in RELATIONS else f"fixture property {p}",
            "description": "invented fixture label",
        }
        for p in props
    }
    _write_text(root / "codex_m" / "relations_en.json", _dump_object(labels))


# =========================================================================== LRE, known_1000, MAPS
#
# Written for these tests: invented places, people and companies, or plain English words; only
# the formats and folder layouts follow the public sets.  Indented JSON, as in the public files.


def _write_json(path: Path, value: Any) -> None:
    _write_text(path, json.dumps(value, indent=2, ensure_ascii=False) + "\n")


# LRE (evandez/relations): data/<category>/<relation>.json with name, prompt_templates,
# prompt_templates_zs, properties and samples.  Two quirks of the real files are reproduced on
# purpose: an object with a literal, double-escaped ``\u00ed`` and a subject with a trailing
# space (the loader cleans both).  One blank subject exercises the ``empty_subject`` skip.


def _lre(
    name: str,
    templates: list[str],
    zero_shot: list[str],
    kind: str,
    domain: str,
    range_: str,
    samples: list[tuple[str, str]],
) -> dict[str, Any]:
    return {
        "name": name,
        "prompt_templates": templates,
        "prompt_templates_zs": zero_shot,
        "properties": {
            "relation_type": kind,
            "domain_name": domain,
            "range_name": range_,
            "symmetric": False,
        },
        "samples": [{"subject": s, "object": o} for s, o in samples],
    }


LRE_RELATIONS: dict[str, dict[str, Any]] = {
    "factual/country_capital_city": _lre(
        "country capital city",
        ["The seat of government of {} is in", "Officials of {} meet in the city of"],
        ["The seat of government of {} is the city of"],
        "factual",
        "country",
        "city",
        [
            ("Ostravia", "Brn\\u00edk"),
            ("Velmaria ", "Port Sella"),
            ("Kaldun", "Kaldun City"),
            ("Norvessa", "Tirelle"),
            ("Amberlund", "Ostmark"),
            ("Quellara", "Vigo Alta"),
        ],
    ),
    "factual/person_occupation": _lre(
        "person occupation",
        ["Day to day, {} earns a living as a"],
        ["In the job register, {} is listed as a"],
        "factual",
        "person",
        "occupation",
        [
            ("Idris Pallow", "carpenter"),
            ("Mena Okafri", "nurse"),
            ("Tobiah Crane", "pilot"),
            ("Selka Varn", "chemist"),
        ],
    ),
    "linguistic/adj_antonym": _lre(
        "adjective antonym",
        ["Turn {} around and you get"],
        ["What is the opposite of {}? It is"],
        "linguistic",
        "adjective",
        "adjective",
        [("hot", "cold"), ("tall", "short"), ("early", "late"), ("open", "closed"), ("light", "dark")],
    ),
    "commonsense/fruit_inside_color": _lre(
        "fruit inside color",
        ["Sliced in half, {} show a flesh that is", "Cut open, {} are coloured"],
        ["What colour is the inside of {}? It is"],
        "commonsense",
        "fruit",
        "color",
        [("glimberries", "purple"), ("sunplums", "orange"), ("frostmelons", "white")],
    ),
    "bias/name_birthplace": _lre(
        "name birthplace",
        ["The birth record of {} names the country"],
        ["Where was {} most likely born? In"],
        "bias",
        "name",
        "country",
        [("Arvo", "Norvessa"), ("Lintu", "Norvessa"), (" ", "Ostravia"), ("Caio", "Velmaria")],
    ),
}


def write_lre(root: Path = HERE) -> None:
    """tests/data/lre_relations/data/<category>/<relation>.json."""
    for rel, data in LRE_RELATIONS.items():
        _write_json(root / "lre_relations" / "data" / f"{rel}.json", data)


# known_1000 (ROME): a list of {known_id, subject, attribute, template, prediction, prompt,
# relation_id}.  As in the real file, ``prompt`` may extend the template ("... the continent"
# + " of").  The order matters to the tests: with relations P30 and P103 and five facts per
# relation, records 0-4 are P30 and 5-9 are P103 (so 0:1 and 5:8 are same-relation pairs whose
# objects start with different tiny-tokenizer tokens, as activation patching needs);
# each of the two has a sixth fact (over the limit) and repeated objects (probe classes), and
# subjects of different lengths.  Entry 13's prompt spells its subject in lower case: the
# ``subject_not_in_prompt`` skip.

KNOWN_FACTS: list[tuple[str, str, str, str, str]] = [
    # relation, subject, attribute, template, what the prompt adds after template.format(subject)
    ("P30", "Mount Elvaran", "Antarctica", "{} is located in the continent", " of"),
    ("P30", "Corvath", "Europe", "{} belongs to the continent of", ""),
    ("P30", "Sarn Glacier", "Antarctica", "{} belongs to the continent of", ""),
    ("P127", "Kestrel Audio", "Ambrose Group", "{} is owned by", ""),
    ("P30", "Tiberan Highlands", "Asia", "{} belongs to the continent of", ""),
    ("P30", "Velm", "Europe", "{} is located in the continent", " of"),
    ("P103", "Odile Marchetaux", "French", "The native language of {} is", ""),
    ("P103", "Henri Vasseline", "French", "The native language of {} is", ""),
    ("P36", "Ostravia", "Brnik", "The capital of {} is", ""),
    ("P103", "Margit Lindqvar", "Swedish", "The mother tongue of {} is", ""),
    ("P103", "Pekka Ruusanen-Aalto", "Estonian", "The native language of {} is", ""),
    ("P103", "Aurelie Donsaint", "French", "The native language of {} is", ""),
    ("P30", "Lake Omburu", "Africa", "{} belongs to the continent of", ""),
    ("P127", "Nightjar Studios", "Halden Industries", "{} is owned by", ""),
    ("P103", "Ilse Brandvold", "Norwegian", "The native language of {} is", ""),
    ("P36", "Velmaria", "Port Sella", "The capital of {} is", ""),
    ("P30", "Drennic Peninsula", "North America", "{} is located in the continent", " of"),
    ("P127", "Larkspur Motors", "Halden Industries", "{} is owned by", ""),
]
KNOWN_NOT_IN_PROMPT = 13


def known_1000_rows() -> list[dict[str, Any]]:
    rows = []
    for i, (rel, subject, attribute, template, suffix) in enumerate(KNOWN_FACTS):
        prompt = template.format(subject.lower() if i == KNOWN_NOT_IN_PROMPT else subject) + suffix
        rows.append(
            {
                "known_id": i,
                "subject": subject,
                "attribute": attribute,
                "template": template,
                "prediction": f" {attribute}, as the fixture says",
                "prompt": prompt,
                "relation_id": rel,
            }
        )
    return rows


def write_known_1000(root: Path = HERE) -> None:
    """tests/data/known_1000/known_1000.json."""
    _write_json(root / "known_1000" / "known_1000.json", known_1000_rows())


# MAPS (the authors' datasets/): <relation>/<relation>.json holding [[source, target], ...] and
# a data_source.txt beside it.  The tiny test tokenizer splits most of these names into several
# tokens (multi-token pairs, whose first token stands in); some capitals share their country's
# first token or name (copy-like pairs, as in the real data).  Four of the first twelve antonyms
# (young, deep, wild, polite) have a static rank inside k=10 at layer 1 of the tiny random Llama
# with or without the first MLP, so the two static variants of test_maps differ on this relation.
# year_to_following has only three pairs, so the pipeline's filters can leave a relation small.

MAPS_RELATIONS: dict[str, list[tuple[str, str]]] = {
    "country_to_capital_wikidata": [
        ("Ostravia", "Brnik"),
        ("Velmaria", "Port Sella"),
        ("Kaldun", "Kaldun City"),
        ("Norvessa", "Tirelle"),
        ("Amberlund", "Ostmark"),
        ("Quellara", "Vigo Alta"),
        ("Sarnovia", "Sarnov"),
        ("Drennic", "Lake Town"),
        ("Pellador", "Pellador"),
        ("Harrowmere", "Greyfort"),
        ("Isolde Isles", "Marrow Bay"),
        ("Tiberan", "Tiber Falls"),
        ("Vossland", "Vossburg"),
        ("Corvath", "New Arden"),
        ("Elvar", "Elvar"),
        ("Omburu", "Kessa"),
    ],
    "adj_antonym": [
        ("hot", "cold"),
        ("young", "old"),
        ("tall", "short"),
        ("deep", "shallow"),
        ("early", "late"),
        ("open", "closed"),
        ("wild", "tame"),
        ("light", "dark"),
        ("wet", "dry"),
        ("polite", "rude"),
        ("loud", "quiet"),
        ("rich", "poor"),
        ("thick", "thin"),
        ("happy", "sad"),
    ],
    "adj_comparative": [
        ("big", "bigger"),
        ("small", "smaller"),
        ("warm", "warmer"),
        ("strong", "stronger"),
        ("bright", "brighter"),
        ("long", "longer"),
        ("green", "greener"),
        ("deep", "deeper"),
        ("calm", "calmer"),
        ("kind", "kinder"),
        ("wide", "wider"),
        ("sharp", "sharper"),
    ],
    "verb_past_tense": [
        ("walk", "walked"),
        ("run", "ran"),
        ("swim", "swam"),
        ("write", "wrote"),
        ("build", "built"),
        ("sing", "sang"),
        ("jump", "jumped"),
        ("think", "thought"),
        ("bring", "brought"),
        ("carry", "carried"),
        ("teach", "taught"),
        ("fly", "flew"),
    ],
    "name_copying": [
        (n, n)
        for n in (
            "Arvo",
            "Lintu",
            "Caio",
            "Odile",
            "Margit",
            "Pekka",
            "Ilse",
            "Tobiah",
            "Selka",
            "Idris",
            "Mena",
            "Henri",
        )
    ],
    "english_to_french": [
        ("bread", "pain"),
        ("house", "maison"),
        ("river", "rivi\u00e8re"),
        ("apple", "pomme"),
        ("book", "livre"),
        ("moon", "lune"),
        ("tree", "arbre"),
        ("sea", "mer"),
        ("window", "fen\u00eatre"),
        ("key", "cl\u00e9"),
    ],
    "year_to_following": [("1901", "1902"), ("1957", "1958"), ("2033", "2034")],
}


def write_maps(root: Path = HERE) -> None:
    """tests/data/maps/datasets/<relation>/{<relation>.json, data_source.txt}."""
    for rel, pairs in MAPS_RELATIONS.items():
        folder = root / "maps" / "datasets" / rel
        _write_json(folder / f"{rel}.json", [list(p) for p in pairs])
        _write_text(
            folder / "data_source.txt",
            "Invented for actstore's tests by tests/data/make_fixtures.py (write_maps).\n",
        )


# =========================================================================== methods2k sources
#
# The method-comparison data set (ingest/datasets/methods2k.py) is built from LRE factual files and
# a known_1000 file, tagged with a subject frequency and answer uniqueness.  These sources are
# invented: two LRE-format relations (one where two subjects have two objects each: the
# "several" uniqueness stratum), one known_1000-format relation, and a Zipf table for every
# subject (invented values, with ties at a median, so the tests need no wordfreq).

M2K_LRE: dict[str, dict[str, Any]] = {
    "region_river": _lre(
        "region river",
        ["The main river of {} is the"],
        ["Which river crosses {}? The"],
        "factual",
        "region",
        "river",
        [
            ("Ostravia", "Velta"),
            ("Ostravia", "Morn"),
            ("Kaldun", "Velta"),
            ("Norvessa", "Sarn"),
            ("Amberlund", "Tiber"),
            ("Quellara", "Velta"),
            ("Pellador", "Morn"),
            ("Pellador", "Drisk"),
            ("Harrowmere", "Drisk"),
        ],
    ),
    "guild_founder": _lre(
        "guild founder",
        ["The guild {} was founded by"],
        ["Who founded {}?"],
        "factual",
        "guild",
        "person",
        [
            ("Brass Lantern", "Tavi Orsel"),
            ("Quiet Oar", "Mena Okafri"),
            ("Salt Anvil", "Idris Pallow"),
            ("Grey Heron", "Selka Varn"),
            ("Iron Thimble", "Tavi Orsel"),
        ],
    ),
}
M2K_KNOWN: list[tuple[str, str, str]] = [  # relation, subject, attribute
    ("P9001", "Lake Omburu", "Kessa"),
    ("P9001", "Sarn Glacier", "Brnik"),
    ("P9001", "Velm", "Kessa"),
    ("P9001", "Tiberan Highlands", "Port Sella"),
]
M2K_ZIPF: dict[str, float] = {
    "Ostravia": 3.1,
    "Kaldun": 1.2,
    "Norvessa": 2.0,
    "Amberlund": 2.0,
    "Quellara": 0.0,
    "Pellador": 4.4,
    "Harrowmere": 2.0,
    "Brass Lantern": 2.5,
    "Quiet Oar": 1.0,
    "Salt Anvil": 3.3,
    "Grey Heron": 4.0,
    "Iron Thimble": 0.5,
    "Lake Omburu": 1.5,
    "Sarn Glacier": 0.0,
    "Velm": 2.2,
    "Tiberan Highlands": 0.4,
}


def write_methods2k(root: Path = HERE) -> None:
    """tests/data/methods2k/{lre/factual/<relation>.json, known_1000.json, zipf.json}."""
    folder = root / "methods2k"
    for rel, data in M2K_LRE.items():
        _write_json(folder / "lre" / "factual" / f"{rel}.json", data)
    _write_json(
        folder / "known_1000.json",
        [
            {
                "known_id": i,
                "subject": s,
                "attribute": o,
                "template": "{} drains into the sea near",
                "prediction": f" {o}, as the fixture says",
                "prompt": f"{s} drains into the sea near",
                "relation_id": r,
            }
            for i, (r, s, o) in enumerate(M2K_KNOWN)
        ],
    )
    _write_json(folder / "zipf.json", M2K_ZIPF)


# =========================================================================== all writers

WRITERS: dict[str, Callable[[Path], None]] = {
    "fewrel": write_fewrel_and_codex,
    "lre": write_lre,
    "known_1000": write_known_1000,
    "maps": write_maps,
    "methods2k": write_methods2k,
}


def main(argv: Sequence[str]) -> int:
    names = list(argv) or list(WRITERS)
    unknown = [n for n in names if n not in WRITERS]
    if unknown:
        print(f"error: unknown fixture(s) {', '.join(unknown)}; known: {', '.join(WRITERS)}", file=sys.stderr)
        return 1
    for n in names:
        WRITERS[n](HERE)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
